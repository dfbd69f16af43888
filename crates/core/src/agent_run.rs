//! Runs of an agent runtime: start (fresh or continue, idempotent by key, one active per
//! runtime), execution of the harness inside the sandbox, its events, and cancel.
//!
//! A run executes as a process started through the sandbox's agent
//! ([`crate::exec`]). Each line the harness prints goes through its adapter's `parse`,
//! then [`sandpit_agentrun::sanitize`] (secret-named fields and the known secret values
//! masked, limits applied), then the store's `append_event`: an event is stored before
//! anyone can read it. The outcome the harness reports (or its exit without one) ends the
//! run with a compare-and-set, so a result arriving after a cancel changes nothing.
//!
//! With the runtime's policy holding `harness_permissions`, the harness is launched asking
//! (opencode's `ask` rules, Claude Code's `--permission-prompt-tool stdio`, pi's extension)
//! and each permission request it prints is put to a person through
//! [`crate::approvals`]: capability `harness_permission`, target the tool, summary its
//! command (redacted, printable). The harness waits; the driver does not: it keeps reading
//! lines while a task waits for the decision, then sends the adapter's answer (approve, or
//! deny with the reason; expiry and the run's limit of pending approvals deny too).
//! Approved "for the run", later asks for the same tool are let through by the standing
//! grant without a person. The harness itself is always answered "once", so sandpit stays
//! the one that remembers.
//!
//! A harness that serves HTTP + SSE instead (opencode `serve`) runs under a bridge:
//! `agent_bridge.js`, run by node in the sandbox, starts it, subscribes to its events,
//! makes the launch's requests and turns it all into the same stdin/stdout lines.
//!
//! The harness runs under the agent's supervisor (`sandpit-supervisor`, a child
//! subreaper): every process its tools leave behind, even one that double-forks or
//! `setsid`s away, is re-parented to the supervisor rather than to the agent, so it stays
//! in the run's tree. A run that ends normally leaves such processes running (a dev
//! server it started, say), as any command does: only cancel and time-out end them.
//!
//! Cancel sends the harness's own abort (and, while stopping, the driver no longer closes
//! the harness's stdin on its outcome, so it does not exit and take the supervisor
//! along), then SIGTERM to the supervisor, which passes it to the whole tree and SIGKILLs
//! what is left after `[agents] cancel_grace_secs` (5 s by default); if the supervisor's
//! end is not seen a little after that, the daemon SIGKILLs the tree through the agent.
//! Then it marks the run cancelled. The cancel request returns once the tree is gone: at
//! once for processes that end on SIGTERM, after at most the grace (and a margin) for any
//! that ignore it. Nothing else cancels a run: readers of its events come and go freely.
//!
//! Each run has a wall-clock deadline: its `timeout_secs`, capped by `[agents]
//! max_run_secs` (7 days by default). The manager's tick calls
//! [`Manager::time_out_agent_runs`], which ends a run past it as `timed_out` (a
//! compare-and-set, so a result arriving later changes nothing) and terminates its
//! process tree as a cancel does (in a task of its own, the tick does not wait for the
//! grace); its events are kept.

use crate::agent_conn::AgentConn;
use crate::agent_runtime::{NO_KEY, model_of, wire_api};
use crate::error::CoreError;
use crate::exec;
use crate::manager::{Manager, new_id};
use base64::Engine;
use parking_lot::Mutex;
use sandpit_agentrun::{
    Answer, ApprovalPolicy, Control, Harness, HttpCall, Launch, LaunchFile, LaunchSpec, Limits,
    ModelEndpoint, Outcome, PermissionRequest, Redactor, Resume, Stdin, StreamSource, adapter,
    sanitize,
};
use sandpit_api::{CommandEvent, RunCommandRequest};
use sandpit_proto::process::Signal;
use sandpit_store::{NewEvent, NewRun, RunMode, RunRecord, RunStart, RunState, RunUpdate, Store};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Where a runtime keeps the harness's config and sessions inside the sandbox.
const STATE_ROOT: &str = "/home/user/.sandpit-agents";
/// The directory the harness works in.
const WORKDIR: &str = "/home/user";
/// How long the harness's own abort gets before the process tree is terminated.
const ABORT_GRACE: Duration = Duration::from_millis(300);
/// Beyond the grace period, how long a termination waits for the supervisor's end to be
/// seen before the daemon SIGKILLs the tree itself.
const TERM_MARGIN: Duration = Duration::from_secs(2);
/// How long a cancel waits for the killed harness's end to be seen.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Bytes of the harness's stderr kept for the failure reason.
const STDERR_TAIL: usize = 2048;
/// The bridge (run by node in the sandbox) that drives a harness serving HTTP + SSE
/// (opencode `serve`) through stdin and stdout like every other harness.
const BRIDGE_JS: &str = include_str!("agent_bridge.js");
/// The `type` of the bridge's line naming the harness session it made.
const BRIDGE_SESSION: &str = "sandpit.session";

/// What a live run's process is, shared between its driver and a cancel.
#[derive(Default)]
struct Proc {
    pid: Option<u32>,
    /// Set by a cancel (or the sandbox's end): the driver no longer ends the run itself.
    stopping: bool,
}

/// One run being driven.
struct LiveRun {
    conn: Arc<AgentConn>,
    harness: Harness,
    proc: Mutex<Proc>,
    /// Notified when the driver has finished.
    done: tokio::sync::Notify,
    finished: std::sync::atomic::AtomicBool,
    /// When the run's wall-clock limit is reached.
    deadline: std::time::Instant,
    /// That limit, for the reason given when it ends the run.
    limit: Duration,
    /// Between the SIGTERM and the SIGKILL of the run's process tree (`[agents]
    /// cancel_grace_secs`).
    grace: Duration,
}

/// The runs this daemon is driving, by run id.
#[derive(Default)]
pub struct LiveRuns {
    runs: Mutex<HashMap<String, Arc<LiveRun>>>,
}

impl LiveRuns {
    fn get(&self, run_id: &str) -> Option<Arc<LiveRun>> {
        self.runs.lock().get(run_id).cloned()
    }

    /// Marks a run as stopped elsewhere (its runtime or sandbox ended) and kills its
    /// process tree if it has one.
    pub(crate) async fn stop_process(&self, run_id: &str) {
        let Some(live) = self.get(run_id) else { return };
        let pid = {
            let mut p = live.proc.lock();
            p.stopping = true;
            p.pid
        };
        if let Some(pid) = pid {
            exec::kill(&live.conn, pid).await;
        }
    }
}

/// The API view of a run.
pub fn to_api(r: &RunRecord) -> sandpit_api::AgentRun {
    sandpit_api::AgentRun {
        id: r.id.clone(),
        runtime_id: r.runtime_id.clone(),
        sandbox_id: r.sandbox_id.clone(),
        number: r.number,
        task: r.task.clone(),
        mode: r.mode.as_str().into(),
        state: r.state.as_str().into(),
        reason: r.reason.clone(),
        parent_run_id: r.parent_run_id.clone(),
        idempotency_key: r.idempotency_key.clone(),
        created_at_ms: r.created_at_ms,
        started_at_ms: r.started_at_ms,
        ended_at_ms: r.ended_at_ms,
        events: r.next_seq - 1,
        events_dropped: r.events_dropped,
    }
}

/// Everything the driver task needs, owned.
struct Drive {
    store: Store,
    live_runs: Arc<LiveRuns>,
    live: Arc<LiveRun>,
    run: RunRecord,
    spec: LaunchSpec,
    redactor: Redactor,
    limits: Limits,
    /// Where the harness's permission requests go, when the runtime's policy gates them.
    asks: Option<HarnessAsks>,
}

/// What putting the harness's permission requests to a person needs.
struct HarnessAsks {
    approvals: Arc<crate::approvals::Approvals>,
    policy: ApprovalPolicy,
}

/// A permission request answered, for the driver to send to the harness.
type Answered = (PermissionRequest, Answer);

impl Manager {
    /// Starts a run on the caller's runtime: `(run, created)`, where an idempotency key
    /// seen before gives that run back (`created` false) and a second active run is the
    /// store's `ActiveRun` conflict.
    pub async fn start_agent_run(
        &self,
        owner: &str,
        runtime_id: &str,
        req: &sandpit_api::StartRunRequest,
    ) -> Result<(RunRecord, bool), CoreError> {
        let rt = self.agent_runtime(owner, runtime_id).await?;
        let mode: RunMode = req
            .mode
            .as_deref()
            .unwrap_or("fresh")
            .parse()
            .map_err(|_| CoreError::invalid("mode must be \"fresh\" or \"continue\""))?;
        if req.task.trim().is_empty() {
            return Err(CoreError::invalid("task must not be empty"));
        }
        let limit = self.run_limit(req.timeout_secs)?;
        let limits = self.cfg.agents.event_limits;
        let start = self
            .store
            .start_run(&NewRun {
                id: format!("run{}", new_id()),
                runtime_id: rt.id.clone(),
                task: req.task.clone(),
                mode,
                idempotency_key: req.idempotency_key.clone(),
                max_events: limits.max_events(),
            })
            .await?;
        let run = match start {
            RunStart::Existing(r) => return Ok((r, false)),
            RunStart::Started(r) => r,
        };
        if let Err(e) = self.launch_run(&rt, &run, limits, limit).await {
            let reason = format!("could not start the harness: {}", e.chain());
            tracing::warn!(run_id = %run.id, %reason, "agent run failed to start");
            let now = self
                .store
                .transition_run(&run.id, RunState::Failed, Some(&reason))
                .await?;
            return Ok((update_run(now), true));
        }
        Ok((run, true))
    }

    /// Builds the launch and spawns the driver of a new run.
    async fn launch_run(
        &self,
        rt: &sandpit_store::AgentRuntimeRecord,
        run: &RunRecord,
        limits: Limits,
        limit: Duration,
    ) -> Result<(), CoreError> {
        let harness: Harness = rt
            .harness
            .parse()
            .map_err(|e: sandpit_agentrun::LaunchError| CoreError::invalid(e.to_string()))?;
        let model = model_of(rt)?;
        let api_key = match &model.api_key_secret {
            Some(name) => crate::broker::rules::placeholder(name),
            None => NO_KEY.to_string(),
        };
        let policy: ApprovalPolicy =
            serde_json::from_value(rt.approval_policy.clone()).map_err(|e| {
                CoreError::internal_from(format!("agent runtime {}: approval policy", rt.id), e)
            })?;
        let resume = match (run.mode, &run.resume_session_id) {
            (RunMode::Continue, Some(s)) => Some(sandpit_agentrun::Resume::Session(s.clone())),
            (RunMode::Continue, None) => Some(sandpit_agentrun::Resume::Latest),
            (RunMode::Fresh, _) => None,
        };
        let spec = LaunchSpec {
            task: run.task.clone(),
            model: ModelEndpoint {
                provider: "sandpit".into(),
                api: wire_api(harness, &model)?,
                base_url: model.base_url.clone(),
                model: model.model.clone(),
                api_key: api_key.clone(),
            },
            workdir: WORKDIR.into(),
            state_dir: format!("{STATE_ROOT}/{}", rt.id),
            resume,
            approvals: policy.harness_permissions,
            program: Some(crate::agent_runtime::harness_program(rt, harness)),
        };
        let (sandbox, conn) = self.agent(&rt.owner, &rt.sandbox_id).await?;
        // The key the harness holds is a placeholder, but it must not show in events
        // either: an agent told to print its config would otherwise publish it. The
        // sandbox's secret env is in every process the harness starts.
        let redactor = Redactor::new(
            std::iter::once(api_key.as_str()).chain(
                sandbox
                    .secret_env
                    .iter()
                    .filter_map(|k| sandbox.env.get(k).map(String::as_str)),
            ),
        );
        let live = Arc::new(LiveRun {
            conn,
            harness,
            proc: Mutex::default(),
            done: tokio::sync::Notify::new(),
            finished: Default::default(),
            deadline: std::time::Instant::now() + limit,
            limit,
            grace: self.cfg.agents.cancel_grace,
        });
        self.agent_runs
            .runs
            .lock()
            .insert(run.id.clone(), live.clone());
        let drive = Drive {
            store: self.store.clone(),
            live_runs: self.agent_runs.clone(),
            live,
            run: run.clone(),
            spec,
            redactor,
            limits,
            asks: policy.harness_permissions.then(|| HarnessAsks {
                approvals: self.approvals.clone(),
                policy,
            }),
        };
        tokio::spawn(drive.run());
        Ok(())
    }

    /// The caller's run `id`.
    pub async fn agent_run(&self, owner: &str, id: &str) -> Result<RunRecord, CoreError> {
        match self.store.get_run(id).await? {
            Some(r) if r.owner == owner => Ok(r),
            _ => Err(CoreError::not_found(format!("run {id} not found"))),
        }
    }

    /// Up to `limit` stored events of the caller's run after sequence `after`.
    pub async fn agent_run_events(
        &self,
        owner: &str,
        id: &str,
        after: i64,
        limit: u32,
    ) -> Result<(RunRecord, Vec<sandpit_store::RunEvent>), CoreError> {
        let run = self.agent_run(owner, id).await?;
        let events = self.store.events_after(&run.id, after, limit).await?;
        Ok((run, events))
    }

    /// Cancels the caller's run: the harness's abort, then its process tree terminated
    /// ([`terminate`]: SIGTERM, SIGKILL after the grace period), then `cancelled` by
    /// compare-and-set (a finished run is returned unchanged). It returns once the tree is
    /// gone: at once for processes that end on SIGTERM, after at most `[agents]
    /// cancel_grace_secs` (and a margin) for any that do not.
    pub async fn cancel_agent_run(&self, owner: &str, id: &str) -> Result<RunRecord, CoreError> {
        let run = self.agent_run(owner, id).await?;
        if run.state.is_terminal() {
            return Ok(run);
        }
        if let Some(live) = self.agent_runs.get(&run.id) {
            let pid = {
                let mut p = live.proc.lock();
                p.stopping = true;
                p.pid
            };
            if let Some(pid) = pid {
                let abort = match adapter(live.harness).abort(run.session_id.as_deref()) {
                    Some(Control::StdinLine(line)) => Some(line),
                    // Bridged: the bridge makes the request for us.
                    Some(Control::Http(call)) => {
                        Some(bridge_request(&call, run.session_id.as_deref()))
                    }
                    None => None,
                };
                if let Some(line) = abort {
                    let mut data = line.into_bytes();
                    data.push(b'\n');
                    if let Err(e) = exec::write_stdin(&live.conn, pid, data, false).await {
                        tracing::debug!(run_id = %run.id, error = %e.chain(), "abort not delivered");
                    }
                    tokio::time::sleep(ABORT_GRACE).await;
                }
                terminate(&live, pid, &run.id).await;
            }
        }
        let now = self
            .store
            .transition_run(&run.id, RunState::Cancelled, Some("cancelled on request"))
            .await?;
        Ok(update_run(now))
    }

    /// A run's wall-clock limit: its own `timeout_secs` (at least 1), never more than the
    /// daemon's cap.
    fn run_limit(&self, timeout_secs: Option<u64>) -> Result<Duration, CoreError> {
        let cap = self.cfg.agents.max_run;
        match timeout_secs {
            None => Ok(cap),
            Some(0) => Err(CoreError::invalid("timeout_secs must be at least 1")),
            Some(s) => Ok(Duration::from_secs(s).min(cap)),
        }
    }

    /// Ends every driven run past its deadline as `timed_out` and terminates its process
    /// tree as a cancel does (in a task of its own: the tick does not wait for the grace
    /// period); called from the manager's tick.
    pub async fn time_out_agent_runs(&self) {
        let now = std::time::Instant::now();
        let due: Vec<(String, Arc<LiveRun>)> = self
            .agent_runs
            .runs
            .lock()
            .iter()
            .filter(|(_, live)| live.deadline <= now)
            .map(|(id, live)| (id.clone(), live.clone()))
            .collect();
        for (run_id, live) in due {
            let pid = {
                let mut p = live.proc.lock();
                if p.stopping {
                    // Being cancelled, or already timed out by an earlier tick.
                    continue;
                }
                p.stopping = true;
                p.pid
            };
            // The state first: with `stopping` set the driver ends nothing itself, and a
            // result that still arrives finds the run final.
            let reason = format!("ran past its time limit of {} s", live.limit.as_secs());
            match self
                .store
                .transition_run(&run_id, RunState::TimedOut, Some(&reason))
                .await
            {
                Ok(RunUpdate::Applied(_)) => tracing::info!(run_id, %reason, "agent run timed out"),
                Ok(other) => {
                    tracing::debug!(run_id, now = ?update_run(other).state, "run already ended")
                }
                Err(e) => tracing::warn!(run_id, error = %e, "timing out a run"),
            }
            // Without a pid the driver has not started the harness yet: it sees `stopping`
            // (or the final state) and kills or skips it itself.
            if let Some(pid) = pid {
                tokio::spawn(async move { terminate(&live, pid, &run_id).await });
            }
        }
    }

    /// After a start: runs left active by the previous daemon have no driver. Their
    /// harness (if the sandbox kept it) is killed by its tag and they are marked failed;
    /// re-attaching them is not done yet.
    pub async fn fail_orphaned_runs(&self) {
        let runs = match self.store.live_runs().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "listing active agent runs");
                return;
            }
        };
        for run in runs {
            if let Ok((_, conn)) = self.agent(&run.owner, &run.sandbox_id).await {
                kill_tagged(&conn, &run_tag(&run.id)).await;
            }
            let reason = "the daemon restarted while the run was active; its harness was stopped";
            match self
                .store
                .transition_run(&run.id, RunState::Failed, Some(reason))
                .await
            {
                Ok(_) => tracing::info!(run_id = %run.id, "orphaned agent run failed"),
                Err(e) => tracing::warn!(run_id = %run.id, error = %e, "failing an orphaned run"),
            }
        }
    }

    /// Ends the runtimes and runs of a sandbox being deleted; their processes go with it.
    pub(crate) async fn end_sandbox_agents(&self, sandbox_id: &str) {
        match self
            .store
            .end_sandbox_agents(sandbox_id, "sandbox deleted")
            .await
        {
            Ok(ended) => {
                for run in ended.runs {
                    if let Some(live) = self.agent_runs.get(&run.id) {
                        live.proc.lock().stopping = true;
                    }
                }
            }
            Err(e) => tracing::warn!(sandbox_id, error = %e, "ending the sandbox's agent runs"),
        }
    }
}

/// Ends a live run's process tree: SIGTERM to its supervisor, which passes it to every
/// process below (whatever group or session each is in) and SIGKILLs what is left after
/// the run's grace period; if the end is still not seen a little later (the supervisor
/// itself was stopped or killed), SIGKILL to the tree through the agent.
async fn terminate(live: &LiveRun, pid: u32, run_id: &str) {
    use std::sync::atomic::Ordering;
    // Made before the signal: the driver's notify only wakes futures that exist.
    let done = live.done.notified();
    tokio::pin!(done);
    if live.finished.load(Ordering::Acquire) {
        return;
    }
    if let Err(e) = exec::send_signal(&live.conn, pid, Signal::SIGNAL_SIGTERM).await {
        // It may have ended between the check and the signal; the wait below tells.
        tracing::debug!(run_id, error = %e.chain(), "SIGTERM to the run's tree");
    }
    if tokio::time::timeout(live.grace + TERM_MARGIN, &mut done)
        .await
        .is_ok()
        || live.finished.load(Ordering::Acquire)
    {
        return;
    }
    tracing::warn!(
        run_id,
        "the run's processes outlived the grace period; killing them"
    );
    exec::kill(&live.conn, pid).await;
    let _ = tokio::time::timeout(KILL_WAIT, done).await;
}

/// The process tag a run's harness is started with.
fn run_tag(run_id: &str) -> String {
    format!("agent-run:{run_id}")
}

/// Kills (with its tree) every process in the sandbox started with `tag`.
async fn kill_tagged(conn: &AgentConn, tag: &str) {
    let list = match conn
        .process
        .list(sandpit_proto::process::ListRequest::default())
        .await
    {
        Ok(l) => l.into_owned(),
        Err(e) => {
            tracing::debug!(error = %e, "listing the sandbox's processes");
            return;
        }
    };
    for p in list.processes {
        if p.tag.as_deref() == Some(tag) {
            exec::kill(conn, p.pid).await;
        }
    }
}

fn update_run(u: RunUpdate) -> RunRecord {
    match u {
        RunUpdate::Applied(r) | RunUpdate::AlreadyFinal(r) | RunUpdate::NotAllowed(r) => r,
    }
}

impl Drive {
    async fn run(self) {
        let outcome = self.drive().await;
        let stopping = self.live.proc.lock().stopping;
        let end = match outcome {
            Ok(Some(Outcome::Succeeded { .. })) => (RunState::Succeeded, None),
            Ok(Some(Outcome::Failed { reason })) => (RunState::Failed, Some(reason)),
            Ok(Some(Outcome::Aborted)) => (RunState::Cancelled, Some("aborted".into())),
            Ok(None) => (
                RunState::Failed,
                Some("the harness ended without reporting an outcome".into()),
            ),
            Err(e) => (RunState::Failed, Some(e.chain())),
        };
        // A cancel (or the sandbox's end) decides the state itself; the CAS would keep
        // it anyway, this only spares a misleading log line.
        if !stopping {
            let reason = end
                .1
                .as_deref()
                .map(|r| self.redactor.redact_text(r).into_owned());
            match self
                .store
                .transition_run(&self.run.id, end.0, reason.as_deref())
                .await
            {
                Ok(RunUpdate::Applied(_)) => {}
                Ok(other) => {
                    tracing::debug!(run_id = %self.run.id, now = ?update_run(other).state, "run already ended")
                }
                Err(e) => tracing::warn!(run_id = %self.run.id, error = %e, "ending the run"),
            }
        }
        self.live
            .finished
            .store(true, std::sync::atomic::Ordering::Release);
        self.live.done.notify_waiters();
        self.live_runs.runs.lock().remove(&self.run.id);
    }

    /// Runs the harness to its end; the outcome it reported, if any.
    async fn drive(&self) -> Result<Option<Outcome>, CoreError> {
        let conn = self.live.conn.clone();
        let mut adapter = adapter(self.live.harness);
        let launch = adapter
            .launch(&self.spec)
            .map_err(|e| CoreError::invalid(e.to_string()))?;
        if self.asks.is_some() && !launch.permission_requests {
            // Fail closed: a policy that gates the harness's tool use must not run a
            // harness that would use them unasked (a runtime made before the check).
            return Err(CoreError::invalid(format!(
                "the approval policy gates harness permissions, but {} cannot ask",
                self.live.harness
            )));
        }
        let bridged = matches!(launch.stream, StreamSource::Sse { .. });
        let launch = if bridged {
            if let Some(Resume::Session(id)) = &self.spec.resume {
                // Events of the resumed session are this run's; later continues resume it.
                adapter.session_started(id);
                self.store.set_run_session(&self.run.id, id).await?;
            }
            bridge(launch, &self.spec.state_dir)
        } else {
            launch
        };
        for f in &launch.files {
            write_file(&conn, f).await?;
        }
        match self
            .store
            .transition_run(&self.run.id, RunState::Running, None)
            .await?
        {
            RunUpdate::Applied(_) => {}
            other => {
                // Cancelled before it started: nothing to run.
                tracing::debug!(run_id = %self.run.id, state = ?update_run(other).state, "run not started");
                return Ok(None);
            }
        }
        let req = RunCommandRequest {
            argv: launch.argv.clone(),
            env: launch.env.clone(),
            cwd: Some(launch.cwd.clone()),
            // Attached: the output comes on this stream. The agent keeps the process (and
            // its output) if the daemon goes away, as with any command.
            tag: Some(run_tag(&self.run.id)),
            ..Default::default()
        };
        // Under the supervisor: what the harness's tools leave behind stays in its tree,
        // where a cancel's SIGTERM finds it.
        let (pid, stream) = exec::start_with(&conn, &req, true, Some(self.live.grace)).await?;
        let stopping = {
            let mut p = self.live.proc.lock();
            p.pid = Some(pid);
            p.stopping
        };
        if stopping {
            exec::kill(&conn, pid).await;
            return Ok(None);
        }
        tracing::debug!(run_id = %self.run.id, pid, "harness started");
        for step in &launch.steps {
            if let Control::StdinLine(line) = step {
                let mut data = line.clone().into_bytes();
                data.push(b'\n');
                exec::write_stdin(&conn, pid, data, false).await?;
            }
        }
        // A harness reading its whole input (Codex's task) waits for the end of it; one
        // with nothing to read must not wait on an open pipe either.
        if matches!(launch.stdin, Stdin::Input | Stdin::Closed) {
            exec::write_stdin(&conn, pid, Vec::new(), true).await?;
        }
        let mut events = exec::start_events(stream);
        let mut buf: Vec<u8> = Vec::new();
        let mut stderr: Vec<u8> = Vec::new();
        let mut outcome = None;
        let mut exit = None;
        let mut asked: Vec<PermissionRequest> = Vec::new();
        // Each permission request waits for its decision in a task of its own; the
        // answers come back here to be sent. Dropping the set (the harness ended) drops
        // the waits, which ends their approvals `abandoned`.
        let mut asking = tokio::task::JoinSet::new();
        let (answered_tx, mut answered_rx) = tokio::sync::mpsc::unbounded_channel::<Answered>();
        use futures::StreamExt;
        loop {
            let ev = tokio::select! {
                ev = events.next() => ev,
                Some((req, answer)) = answered_rx.recv() => {
                    self.answer(&mut *adapter, bridged, pid, &req, &answer).await;
                    continue;
                }
                // Reaps finished waits so the set does not grow with the run.
                Some(_) = asking.join_next(), if !asking.is_empty() => continue,
            };
            let Some(ev) = ev else { break };
            match ev? {
                CommandEvent::Stdout { data } => {
                    buf.extend(exec::B64.decode(data).unwrap_or_default());
                    while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=nl).collect();
                        let line = String::from_utf8_lossy(&line[..nl]);
                        let ended = self
                            .line(&mut *adapter, bridged, &line, &mut outcome, &mut asked)
                            .await?;
                        for req in asked.drain(..) {
                            self.ask(req, &mut asking, &answered_tx);
                        }
                        if ended && !self.live.proc.lock().stopping {
                            // Told its outcome: closing stdin lets the RPC harness exit. Not
                            // when stopping: the outcome is then the abort's, and a harness
                            // that exited now would take its supervisor along and leave the
                            // tools' orphans out of the termination's reach.
                            exec::write_stdin(&conn, pid, Vec::new(), true).await?;
                        }
                    }
                }
                CommandEvent::Stderr { data } => {
                    stderr.extend(exec::B64.decode(data).unwrap_or_default());
                    if stderr.len() > STDERR_TAIL {
                        stderr.drain(..stderr.len() - STDERR_TAIL);
                    }
                }
                CommandEvent::End { exit_code, .. } => {
                    exit = Some(exit_code);
                    break;
                }
                _ => {}
            }
        }
        if !buf.is_empty() {
            let line = String::from_utf8_lossy(&buf).into_owned();
            self.line(&mut *adapter, bridged, &line, &mut outcome, &mut asked)
                .await?;
        }
        if outcome.is_none() && !self.live.proc.lock().stopping {
            let tail = String::from_utf8_lossy(&stderr);
            return Ok(Some(Outcome::Failed {
                reason: format!(
                    "the harness exited ({}) without an outcome: {}",
                    exit.map_or("no exit status".into(), |c| format!("code {c}")),
                    tail.trim()
                ),
            }));
        }
        Ok(outcome)
    }

    /// Parses, sanitizes and stores one output line; true when it gave the outcome. A
    /// permission request on it is added to `asked`.
    async fn line(
        &self,
        adapter: &mut dyn sandpit_agentrun::Adapter,
        bridged: bool,
        line: &str,
        outcome: &mut Option<Outcome>,
        asked: &mut Vec<PermissionRequest>,
    ) -> Result<bool, CoreError> {
        if bridged && let Some(id) = bridge_session(line) {
            adapter.session_started(&id);
            self.store.set_run_session(&self.run.id, &id).await?;
            return Ok(false);
        }
        let parsed = adapter.parse(line);
        if parsed.unrecognized {
            tracing::debug!(run_id = %self.run.id, "harness printed a line that is not its JSON");
        }
        let mut batch = Vec::with_capacity(parsed.events.len());
        for mut ev in parsed.events {
            sanitize(&mut ev, &self.redactor, &self.limits);
            batch.push(NewEvent {
                kind: ev.kind.as_str().to_string(),
                payload: ev.payload,
            });
        }
        if !batch.is_empty() {
            self.store.append_events(&self.run.id, &batch).await?;
        }
        if let Some(session) = parsed.session_id {
            self.store.set_run_session(&self.run.id, &session).await?;
        }
        asked.extend(parsed.permission);
        let first = outcome.is_none() && parsed.outcome.is_some();
        if first {
            *outcome = parsed.outcome;
        }
        Ok(first)
    }

    /// Puts one of the harness's permission requests to a person in a task of its own;
    /// its answer comes back on `answered`. Without a policy gating them (the harness
    /// was not launched asking) the request is let through, as the policy says.
    fn ask(
        &self,
        req: PermissionRequest,
        asking: &mut tokio::task::JoinSet<()>,
        answered: &tokio::sync::mpsc::UnboundedSender<Answered>,
    ) {
        let Some(asks) = &self.asks else {
            tracing::debug!(run_id = %self.run.id, tool = %req.tool, "permission request without a policy gating it: allowed");
            let _ = answered.send((req, Answer::Allow { for_run: false }));
            return;
        };
        let tool = printable(&self.redactor.redact_text(&req.tool), 100);
        let summary = printable(&self.redactor.redact_text(&req.summary), 300);
        let ask = crate::approvals::Ask {
            run_id: self.run.id.clone(),
            capability: sandpit_store::Capability::HarnessPermission,
            target: sandpit_store::ApprovalTarget {
                name: Some(tool),
                ..Default::default()
            },
            summary,
            detail: serde_json::json!({
                "harness": self.live.harness.as_str(),
                "request_id": printable(&self.redactor.redact_text(&req.id), 200),
                "call_id": req.call_id.as_deref().map(|c| printable(&self.redactor.redact_text(c), 200)),
            }),
            expires_at_ms: asks.policy.expires_at_ms(sandpit_store::now_ms()),
            gone: "the run's harness stopped before a decision",
        };
        let approvals = asks.approvals.clone();
        let answered = answered.clone();
        asking.spawn(async move {
            use sandpit_net::approval::GateDecision;
            let answer = match approvals.ask(ask).await {
                // The harness is told "once" even for a grant for the run: sandpit's
                // standing grant answers its later asks, so every use passes sandpit.
                GateDecision::Approved { .. } | GateDecision::NotGated => {
                    Answer::Allow { for_run: false }
                }
                GateDecision::Refused {
                    approval_id,
                    reason,
                } => Answer::Deny {
                    message: format!(
                        "sandpit refused this tool call (approval {}): {reason}",
                        approval_id.as_deref().unwrap_or("not recorded")
                    ),
                },
            };
            // The driver is gone when the harness ended: nothing left to answer.
            let _ = answered.send((req, answer));
        });
    }

    /// Sends the harness the adapter's answer to one of its permission requests. A
    /// harness that has gone away cannot take it; that is only logged.
    async fn answer(
        &self,
        // `&mut` only because a shared `dyn Adapter` would not be `Send` across the write.
        adapter: &mut dyn sandpit_agentrun::Adapter,
        bridged: bool,
        pid: u32,
        req: &PermissionRequest,
        answer: &Answer,
    ) {
        let line = match adapter.answer(req, answer) {
            Some(Control::StdinLine(line)) => line,
            // Bridged: the bridge makes the request (the reply's path names no session).
            Some(Control::Http(call)) if bridged => bridge_request(&call, None),
            Some(Control::Http(_)) | None => {
                tracing::warn!(run_id = %self.run.id, harness = %self.live.harness, "no way to answer the harness's permission request");
                return;
            }
        };
        tracing::info!(run_id = %self.run.id, tool = %req.tool, allowed = matches!(answer, Answer::Allow { .. }), "answering the harness's permission request");
        let mut data = line.into_bytes();
        data.push(b'\n');
        if let Err(e) = exec::write_stdin(&self.live.conn, pid, data, false).await {
            tracing::debug!(run_id = %self.run.id, error = %e.chain(), "permission answer not delivered");
        }
    }
}

/// `s` as a person is shown it: no control or bidirectional-override characters (they
/// could rewrite an approver's terminal or disguise the command), at most `max` of them.
fn printable(s: &str, max: usize) -> String {
    s.chars()
        .filter(|c| {
            !c.is_control() && !matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .take(max)
        .collect()
}

/// The launch that runs `launch` (a harness serving HTTP + SSE) under the bridge: node
/// runs the bridge script, which starts the harness, waits until it is ready, subscribes
/// to its events and makes the launch's requests; the daemon then reads and writes lines.
fn bridge(mut launch: Launch, state_dir: &str) -> Launch {
    let StreamSource::Sse { port, path } = &launch.stream else {
        return launch;
    };
    let steps: Vec<serde_json::Value> = launch
        .steps
        .iter()
        .filter_map(|s| match s {
            Control::Http(c) => Some(serde_json::json!({
                "method": c.method, "path": c.path, "body": c.body,
                "session_from": c.session_from,
            })),
            Control::StdinLine(_) => None,
        })
        .collect();
    let cfg = serde_json::json!({
        "argv": launch.argv,
        "port": port,
        "path": path,
        "ready": launch.ready_output.clone().unwrap_or_default(),
        "steps": steps,
    });
    let script = format!("{}/sandpit-bridge.js", state_dir.trim_end_matches('/'));
    launch.files.push(LaunchFile {
        path: script.clone(),
        contents: BRIDGE_JS.to_string(),
        mode: 0o600,
    });
    launch.env.insert("SANDPIT_BRIDGE".into(), cfg.to_string());
    launch.argv = vec!["node".into(), script];
    launch.steps.clear();
    launch.stdin = Stdin::Lines;
    launch.stream = StreamSource::Stdout;
    launch
}

/// One request for the bridge to make, as its stdin line.
fn bridge_request(call: &HttpCall, session: Option<&str>) -> String {
    let path = match session {
        Some(s) => call.path_for(s),
        None => call.path.clone(),
    };
    serde_json::json!({"method": call.method, "path": path, "body": call.body}).to_string()
}

/// The session id of the bridge's session line, if `line` is one.
fn bridge_session(line: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
    if v.get("type")?.as_str()? != BRIDGE_SESSION {
        return None;
    }
    v.get("id")?.as_str().map(str::to_string)
}

/// Writes a launch file as the sandbox's user, making its directory.
async fn write_file(conn: &AgentConn, f: &LaunchFile) -> Result<(), CoreError> {
    let req = RunCommandRequest {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "umask 077 && mkdir -p \"$(dirname \"$1\")\" && cat > \"$1\" && chmod \"$2\" \"$1\""
                .into(),
            "sh".into(),
            f.path.clone(),
            format!("{:o}", f.mode),
        ],
        stdin: Some(f.contents.clone()),
        timeout_ms: Some(30_000),
        ..Default::default()
    };
    let out = exec::run_to_end(conn, &req).await?;
    if out.exit_code != 0 {
        return Err(CoreError::internal(format!(
            "writing {} in the sandbox failed: {}",
            f.path,
            out.stderr.trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opencode_launch(resume: Option<Resume>) -> Launch {
        let spec = LaunchSpec {
            task: "t".into(),
            model: ModelEndpoint {
                provider: "sandpit".into(),
                api: sandpit_agentrun::WireApi::ChatCompletions,
                base_url: "http://m.example/v1".into(),
                model: "m".into(),
                api_key: "SANDPIT_SECRET_k".into(),
            },
            workdir: WORKDIR.into(),
            state_dir: format!("{STATE_ROOT}/agt1/"),
            resume,
            approvals: false,
            program: Some("/opt/oc".into()),
        };
        adapter(Harness::OpenCode).launch(&spec).unwrap()
    }

    #[test]
    fn a_served_harness_runs_under_the_bridge_with_its_requests_as_data() {
        let launch = opencode_launch(None);
        let env = launch.env.clone();
        let b = bridge(launch, &format!("{STATE_ROOT}/agt1/"));
        let script = format!("{STATE_ROOT}/agt1/sandpit-bridge.js");
        assert_eq!(b.argv, vec!["node".to_string(), script.clone()]);
        assert_eq!(b.stream, StreamSource::Stdout);
        assert_eq!(b.stdin, Stdin::Lines);
        assert!(b.steps.is_empty());
        assert!(
            b.files
                .iter()
                .any(|f| f.path == script && f.contents == BRIDGE_JS)
        );
        // The harness's own env (its config with the placeholder key) is kept.
        for (k, v) in &env {
            assert_eq!(b.env.get(k), Some(v), "{k}");
        }
        let cfg: serde_json::Value = serde_json::from_str(&b.env["SANDPIT_BRIDGE"]).unwrap();
        assert_eq!(cfg["argv"][0], "/opt/oc");
        assert_eq!(cfg["argv"][1], "serve");
        assert_eq!(cfg["path"], "/event");
        assert!(cfg["ready"].as_str().unwrap().contains("listening"));
        let steps = cfg["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 2, "{steps:?}");
        assert_eq!(steps[0]["path"], "/session");
        assert_eq!(steps[0]["session_from"], "/id");
        assert_eq!(steps[1]["path"], "/session/{session}/prompt_async");
        // A stdout harness is left alone.
        let pi = opencode_launch(None);
        let mut plain = pi.clone();
        plain.stream = StreamSource::Stdout;
        assert_eq!(bridge(plain.clone(), "/s"), plain);
    }

    #[test]
    fn approval_text_is_printable_and_short() {
        assert_eq!(
            printable("rm -rf /\u{1b}[2J\nok\u{202e}x", 100),
            "rm -rf /[2Jokx"
        );
        assert_eq!(printable(&"y".repeat(500), 300).len(), 300);
    }

    #[test]
    fn bridge_lines_name_sessions_and_carry_requests() {
        assert_eq!(
            bridge_session(r#"{"type":"sandpit.session","id":"ses_1"}"#),
            Some("ses_1".into())
        );
        assert_eq!(bridge_session(r#"{"type":"session.idle","id":"x"}"#), None);
        assert_eq!(bridge_session("not json"), None);
        let call = HttpCall {
            method: "POST".into(),
            path: "/session/{session}/abort".into(),
            body: None,
            session_from: None,
        };
        let line: serde_json::Value =
            serde_json::from_str(&bridge_request(&call, Some("ses_9"))).unwrap();
        assert_eq!(line["path"], "/session/ses_9/abort");
        assert_eq!(line["method"], "POST");
    }
}
