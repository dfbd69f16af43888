//! Test support: an in-memory [`Runtime`] and a manager assembled around it, so that the
//! lifecycle state machine runs in unit tests without root, namespaces, cgroups or mounts.
//!
//! [`FakeRuntime`] keeps every sandbox as a few fields in a map. `create` binds the agent
//! socket for real (through [`PendingSockets`], like the real runtimes), and `start` serves
//! the real agent router (`sandpit_agent::server::router`, the process-mode agent) on it
//! inside the test's tokio runtime, so the manager's health checks and `/init` calls meet
//! the agent's own code. Freezing makes that agent stop answering until it is thawed; a
//! "death" aborts it and makes its liveness `Dead`. Every call is recorded, each step can be
//! made to fail or to block until the test releases it, and destroys are counted per id.
//!
//! Compiled for the crate's own tests only: it pulls in the agent (a dev-dependency) and
//! must never be reachable from the daemon.

use crate::manager::{Manager, ManagerConfig};
use parking_lot::{Condvar, Mutex};
use sandpit_runtime::{
    Capabilities, Liveness, PendingSockets, Runtime, RuntimeError, SandboxHandle, SandboxSpec,
    Stats, UpperView,
};
use sandpit_store::Store;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Name the fake is registered under (and the manager's default runtime in tests).
pub(crate) const FAKE: &str = "fake";

/// Longest a held step waits for the test to release it: a test that fails before its
/// release must not leave a blocking thread behind that the runtime's shutdown waits for.
const HOLD_MAX: Duration = Duration::from_secs(20);

/// Fake pids lie above the kernel's largest pid_max (2^22), so that nothing that reaches a
/// real `kill(2)` with one can ever signal a process of the host.
const PID_BASE: i32 = 1 << 23;

/// A runtime operation, for failures and holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    Create,
    Start,
    Kill,
    Freeze,
    Thaw,
    Destroy,
}

/// One call the runtime received, with the sandbox id it was for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    Create(String),
    Start(String),
    Kill(String),
    Freeze(String),
    Thaw(String),
    Stats(String),
    Liveness(String),
    Destroy(String),
    BeginStop(String),
    Adopt(String),
    OpenUpper(String),
    /// The ids to keep.
    RemoveOrphans(Vec<String>),
}

impl Call {
    /// The sandbox the call was for (none for an orphan sweep).
    pub(crate) fn id(&self) -> Option<&str> {
        match self {
            Call::Create(id)
            | Call::Start(id)
            | Call::Kill(id)
            | Call::Freeze(id)
            | Call::Thaw(id)
            | Call::Stats(id)
            | Call::Liveness(id)
            | Call::Destroy(id)
            | Call::BeginStop(id)
            | Call::Adopt(id)
            | Call::OpenUpper(id) => Some(id),
            Call::RemoveOrphans(_) => None,
        }
    }
}

/// Where a fake sandbox's "processes" are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Created, its socket bound, nothing running.
    Created,
    /// Its agent serves.
    Running,
    /// Its agent is frozen: connections are accepted, nothing is answered.
    Frozen,
    /// Its agent is gone (killed, or "died"); its resources stay until destroyed.
    Dead,
}

/// One sandbox the fake holds (from `create` until `destroy` or an orphan sweep).
struct Sandbox {
    phase: Phase,
    dir: PathBuf,
    /// The read-only layers its spec named, top first.
    layers: Vec<PathBuf>,
    /// The in-process agent's server task.
    agent: Option<tokio::task::JoinHandle<()>>,
    /// True while frozen: the agent's connections hold every request.
    frozen: tokio::sync::watch::Sender<bool>,
    /// The agent's configuration (what `/init` changed is visible through it).
    config: Option<Arc<sandpit_agent::AgentConfig>>,
}

impl Sandbox {
    fn stop_agent(&mut self) {
        if let Some(task) = self.agent.take() {
            // Its connection tasks live in a JoinSet inside the task and go with it.
            task.abort();
        }
    }
}

#[derive(Default)]
struct Inner {
    calls: Vec<Call>,
    sandboxes: HashMap<String, Sandbox>,
    destroys: HashMap<String, usize>,
    /// Failures still to inject, per step and sandbox (`None`: any sandbox;
    /// `usize::MAX`: every call).
    failures: HashMap<(Step, Option<String>), usize>,
    /// Liveness answers forced per sandbox, whatever its phase.
    liveness: HashMap<String, Liveness>,
    /// Counters `stats` answers per sandbox (default: all zero).
    stats: HashMap<String, Stats>,
    next_pid: i32,
}

/// A step held until the test releases it (see [`FakeRuntime::hold`]).
pub(crate) struct Hold {
    entered: tokio::sync::watch::Sender<usize>,
    released: Mutex<bool>,
    cv: Condvar,
}

impl Hold {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            entered: tokio::sync::watch::Sender::new(0),
            released: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    /// Called by the runtime (on a blocking thread): counts the arrival and waits.
    fn wait(&self) {
        self.entered.send_modify(|n| *n += 1);
        let mut released = self.released.lock();
        let deadline = std::time::Instant::now() + HOLD_MAX;
        while !*released {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || self.cv.wait_for(&mut released, left).timed_out() {
                return;
            }
        }
    }

    /// Waits until `n` calls are held (panics after a few seconds: the test is wrong).
    pub(crate) async fn entered(&self, n: usize) {
        let mut rx = self.entered.subscribe();
        tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|v| *v >= n))
            .await
            .expect("the held step was never reached")
            .expect("hold dropped");
    }

    /// Lets every held call (and every later one) go on.
    pub(crate) fn release(&self) {
        {
            let mut r = self.released.lock();
            *r = true;
        }
        self.cv.notify_all();
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

/// An in-memory runtime; see the module documentation.
pub(crate) struct FakeRuntime {
    /// Sandbox directories (each holds `agent.sock`, the agent's `root/` and an `upper/`).
    dir: PathBuf,
    pending: PendingSockets,
    tokio: tokio::runtime::Handle,
    inner: Mutex<Inner>,
    holds: Mutex<HashMap<Step, Arc<Hold>>>,
}

impl FakeRuntime {
    /// A fake keeping its sandboxes' directories below `dir`; its agents run on the
    /// current tokio runtime.
    pub(crate) fn new(dir: &Path) -> Arc<Self> {
        std::fs::create_dir_all(dir).expect("fake runtime dir");
        Arc::new(Self {
            dir: dir.to_path_buf(),
            pending: PendingSockets::default(),
            tokio: tokio::runtime::Handle::current(),
            inner: Mutex::default(),
            holds: Mutex::default(),
        })
    }

    fn inner(&self) -> parking_lot::MutexGuard<'_, Inner> {
        // A test that panicked while holding it has failed already; keep the state usable.
        self.inner.lock()
    }

    /// Makes the next `times` calls of `step` fail (`usize::MAX`: all of them; 0 stops).
    pub(crate) fn fail(&self, step: Step, times: usize) {
        self.inner().failures.insert((step, None), times);
    }

    /// Makes the next `times` calls of `step` for sandbox `id` fail.
    pub(crate) fn fail_for(&self, step: Step, id: &str, times: usize) {
        self.inner()
            .failures
            .insert((step, Some(id.to_string())), times);
    }

    /// Blocks every call of `step` from now on until the returned hold is released.
    pub(crate) fn hold(&self, step: Step) -> Arc<Hold> {
        let hold = Hold::new();
        self.holds.lock().insert(step, hold.clone());
        hold
    }

    /// Forces what `liveness` answers for sandbox `id` (`None`: back to its phase).
    pub(crate) fn set_liveness(&self, id: &str, l: Option<Liveness>) {
        let mut inner = self.inner();
        match l {
            Some(l) => inner.liveness.insert(id.to_string(), l),
            None => inner.liveness.remove(id),
        };
    }

    /// Sets the counters `stats` answers for sandbox `id`.
    pub(crate) fn set_stats(&self, id: &str, stats: Stats) {
        self.inner().stats.insert(id.to_string(), stats);
    }

    /// The sandbox's agent will accept connections but answer nothing (as one that is
    /// still starting, or wedged) until thawed; for a sandbox created but not started.
    pub(crate) fn silence(&self, id: &str) {
        if let Some(sb) = self.inner().sandboxes.get_mut(id) {
            sb.frozen.send_replace(true);
        }
    }

    /// The sandbox's agent exits on its own (its resources stay until destroyed).
    pub(crate) fn die(&self, id: &str) {
        let mut inner = self.inner();
        if let Some(sb) = inner.sandboxes.get_mut(id) {
            sb.stop_agent();
            sb.phase = Phase::Dead;
        }
    }

    /// Every call so far, in order.
    pub(crate) fn calls(&self) -> Vec<Call> {
        self.inner().calls.clone()
    }

    /// How many calls match `f`.
    pub(crate) fn count(&self, f: impl Fn(&Call) -> bool) -> usize {
        self.inner().calls.iter().filter(|c| f(c)).count()
    }

    /// How many times `destroy` was called for `id` (failed calls included).
    pub(crate) fn destroys(&self, id: &str) -> usize {
        self.inner().destroys.get(id).copied().unwrap_or(0)
    }

    /// Ids of the sandboxes the fake still holds (created, not destroyed or swept).
    pub(crate) fn held(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.inner().sandboxes.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// The phase of a sandbox the fake holds.
    pub(crate) fn phase(&self, id: &str) -> Option<Phase> {
        self.inner().sandboxes.get(id).map(|s| s.phase)
    }

    /// The layers the last create of `id` was given.
    pub(crate) fn layers(&self, id: &str) -> Option<Vec<PathBuf>> {
        self.inner().sandboxes.get(id).map(|s| s.layers.clone())
    }

    /// The configuration of `id`'s running agent.
    pub(crate) fn agent_config(&self, id: &str) -> Option<Arc<sandpit_agent::AgentConfig>> {
        self.inner()
            .sandboxes
            .get(id)
            .and_then(|s| s.config.clone())
    }

    /// Records the call, waits while its step is held, then says whether it must fail.
    fn enter(&self, step: Option<Step>, call: Call) -> Result<(), RuntimeError> {
        self.inner().calls.push(call.clone());
        let Some(step) = step else { return Ok(()) };
        let hold = self.holds.lock().get(&step).cloned();
        if let Some(h) = hold {
            h.wait();
        }
        let mut inner = self.inner();
        let keys = [(step, call.id().map(str::to_string)), (step, None)];
        for key in keys {
            if let Some(left) = inner.failures.get_mut(&key)
                && *left > 0
            {
                if *left != usize::MAX {
                    *left -= 1;
                }
                return Err(RuntimeError::Setup(format!("injected failure of {call:?}")));
            }
        }
        Ok(())
    }

    fn missing(id: &str) -> RuntimeError {
        RuntimeError::Setup(format!("the fake runtime has no sandbox {id}"))
    }
}

/// Serves the agent router on `listener` until the task is aborted. Each connection is a
/// task of the JoinSet, so aborting this task drops every connection with it (as the
/// death of a real agent would), and every request waits while `frozen` is true.
async fn serve_agent(
    listener: tokio::net::UnixListener,
    app: axum::Router,
    frozen: tokio::sync::watch::Receiver<bool>,
) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        while conns.try_join_next().is_some() {}
        let (app, frozen) = (app.clone(), frozen.clone());
        conns.spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (app, mut frozen) = (app.clone(), frozen.clone());
                    async move {
                        // A frozen agent answers nothing until it is thawed (or destroyed).
                        let _ = frozen.wait_for(|f| !*f).await;
                        tower::ServiceExt::oneshot(app, req.map(axum::body::Body::new)).await
                    }
                });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, svc)
                .await;
        });
    }
}

impl Runtime for FakeRuntime {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: FAKE,
            isolated: false,
            freeze: true,
            stats: true,
            enforces_memory: false,
            enforces_disk: false,
            enforces_processes: false,
        }
    }

    fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        self.enter(Some(Step::Create), Call::Create(spec.id.clone()))?;
        sandpit_runtime::check_id(&spec.id)?;
        let dir = self.dir.join(&spec.id);
        if self.inner().sandboxes.contains_key(&spec.id) || dir.exists() {
            return Err(RuntimeError::Setup(format!("sandbox {} exists", spec.id)));
        }
        let made = (|| {
            sandpit_runtime::private_dir(&dir)?;
            for d in ["root/home/user", "root/tmp", "upper"] {
                std::fs::create_dir_all(dir.join(d))
                    .map_err(|e| RuntimeError::io(format!("create {d}"), e))?;
            }
            self.pending.bind(&spec.id, &dir)
        })();
        let socket = match made {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let mut inner = self.inner();
        inner.sandboxes.insert(
            spec.id.clone(),
            Sandbox {
                phase: Phase::Created,
                dir: dir.clone(),
                layers: spec.layers.clone(),
                agent: None,
                frozen: tokio::sync::watch::Sender::new(false),
                config: None,
            },
        );
        Ok(SandboxHandle {
            id: spec.id.clone(),
            pid: 0,
            pid_start: 0,
            socket,
            dir,
            uid_base: None,
            net: None,
        })
    }

    fn start(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError> {
        self.enter(Some(Step::Start), Call::Start(spec.id.clone()))?;
        let listener = self.pending.take(&spec.id)?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RuntimeError::io("agent socket", e))?;
        let cfg = Arc::new(sandpit_agent::AgentConfig {
            mode: sandpit_agent::IsolationMode::Process,
            root: h.dir.join("root"),
            workdir: spec.workdir.clone(),
            env: spec.env.clone(),
            listen_fd: None,
            listen_path: None,
            sudo: false,
            live: Default::default(),
        });
        let table = sandpit_agent::process::ProcessTable::new(cfg.clone());
        let app = sandpit_agent::server::router(cfg.clone(), table)
            .map_err(|e| RuntimeError::Setup(format!("agent router: {e}")))?;
        let listener = {
            let _in_runtime = self.tokio.enter();
            tokio::net::UnixListener::from_std(listener)
                .map_err(|e| RuntimeError::io("agent socket", e))?
        };
        let mut inner = self.inner();
        inner.next_pid += 1;
        let pid = PID_BASE + inner.next_pid;
        let sb = inner
            .sandboxes
            .get_mut(&spec.id)
            .ok_or_else(|| Self::missing(&spec.id))?;
        let task = self
            .tokio
            .spawn(serve_agent(listener, app, sb.frozen.subscribe()));
        sb.agent = Some(task);
        sb.config = Some(cfg);
        sb.phase = Phase::Running;
        h.pid = pid;
        h.pid_start = 1;
        Ok(())
    }

    fn kill(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.enter(Some(Step::Kill), Call::Kill(h.id.clone()))?;
        if let Some(sb) = self.inner().sandboxes.get_mut(&h.id) {
            sb.stop_agent();
            sb.phase = Phase::Dead;
        }
        Ok(())
    }

    fn freeze(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.enter(Some(Step::Freeze), Call::Freeze(h.id.clone()))?;
        let mut inner = self.inner();
        let sb = inner
            .sandboxes
            .get_mut(&h.id)
            .ok_or_else(|| Self::missing(&h.id))?;
        if sb.phase == Phase::Running {
            sb.phase = Phase::Frozen;
            sb.frozen.send_replace(true);
        }
        Ok(())
    }

    fn thaw(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.enter(Some(Step::Thaw), Call::Thaw(h.id.clone()))?;
        let mut inner = self.inner();
        let sb = inner
            .sandboxes
            .get_mut(&h.id)
            .ok_or_else(|| Self::missing(&h.id))?;
        if sb.phase == Phase::Frozen {
            sb.phase = Phase::Running;
            sb.frozen.send_replace(false);
        }
        Ok(())
    }

    fn stats(&self, h: &SandboxHandle) -> Result<Stats, RuntimeError> {
        self.enter(None, Call::Stats(h.id.clone()))?;
        Ok(self.inner().stats.get(&h.id).copied().unwrap_or_default())
    }

    fn liveness(&self, h: &SandboxHandle) -> Liveness {
        let _ = self.enter(None, Call::Liveness(h.id.clone()));
        let inner = self.inner();
        if let Some(l) = inner.liveness.get(&h.id) {
            return l.clone();
        }
        match inner.sandboxes.get(&h.id).map(|s| s.phase) {
            Some(Phase::Running | Phase::Frozen) if h.pid > 0 => Liveness::Alive,
            _ => Liveness::Dead,
        }
    }

    fn destroy(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        *self.inner().destroys.entry(h.id.clone()).or_default() += 1;
        self.enter(Some(Step::Destroy), Call::Destroy(h.id.clone()))?;
        self.pending.forget(&h.id);
        let gone = self.inner().sandboxes.remove(&h.id);
        if let Some(mut sb) = gone {
            sb.stop_agent();
            let _ = std::fs::remove_dir_all(&sb.dir);
        }
        Ok(())
    }

    fn remove_orphans(&self, keep: &[String]) -> Result<Vec<String>, RuntimeError> {
        self.enter(None, Call::RemoveOrphans(keep.to_vec()))?;
        let mut inner = self.inner();
        let orphans: Vec<String> = inner
            .sandboxes
            .keys()
            .filter(|id| !keep.contains(id))
            .cloned()
            .collect();
        for id in &orphans {
            if let Some(mut sb) = inner.sandboxes.remove(id) {
                self.pending.forget(id);
                sb.stop_agent();
                let _ = std::fs::remove_dir_all(&sb.dir);
            }
        }
        Ok(orphans)
    }

    fn adopt(&self, h: &SandboxHandle) {
        let _ = self.enter(None, Call::Adopt(h.id.clone()));
    }

    fn begin_stop(&self, h: &SandboxHandle) {
        let _ = self.enter(None, Call::BeginStop(h.id.clone()));
        // As the real runtimes do: the agent is killed at once, the rest waits for destroy.
        if let Some(sb) = self.inner().sandboxes.get_mut(&h.id) {
            sb.stop_agent();
            sb.phase = Phase::Dead;
        }
    }

    fn open_upper(&self, h: &SandboxHandle) -> Result<UpperView, RuntimeError> {
        self.enter(None, Call::OpenUpper(h.id.clone()))?;
        let dir = self
            .inner()
            .sandboxes
            .get(&h.id)
            .map(|s| s.dir.join("upper"))
            .ok_or_else(|| Self::missing(&h.id))?;
        let fd = nix::fcntl::open(
            &dir,
            nix::fcntl::OFlag::O_PATH
                | nix::fcntl::OFlag::O_DIRECTORY
                | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| RuntimeError::io("open upper", e.into()))?;
        // Base 0: the files keep the test user's own ids, which a copy can set again
        // without privileges (root's 0, or an unprivileged user's own uid).
        Ok(UpperView { fd, id_base: 0 })
    }
}

impl FakeRuntime {
    /// The writable layer of a sandbox the fake holds (what `open_upper` hands out).
    pub(crate) fn upper(&self, id: &str) -> Option<PathBuf> {
        self.inner().sandboxes.get(id).map(|s| s.dir.join("upper"))
    }
}

/// A manager over a data dir, its SQLite store and one fake runtime, as `prepare` builds
/// the daemon's (no networking, no broker key, local snapshot storage, no reconcile).
pub(crate) struct Bed {
    pub m: Arc<Manager>,
    pub fake: Arc<FakeRuntime>,
    pub dir: tempfile::TempDir,
}

impl Bed {
    /// A fresh data dir with a manager in it.
    pub(crate) async fn new() -> Bed {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake = FakeRuntime::new(&dir.path().join("fake"));
        let m = manager(dir.path(), fake.clone()).await;
        Bed { m, fake, dir }
    }

    /// A daemon restart in which the sandboxes survived: a new manager (store opened
    /// again) over the same data dir and the same fake. Reconcile is the caller's.
    pub(crate) async fn restart(&mut self) -> Arc<Manager> {
        self.m.drain_teardowns(Duration::from_secs(5)).await;
        self.m = manager(self.dir.path(), self.fake.clone()).await;
        self.m.clone()
    }
}

async fn manager(data_dir: &Path, fake: Arc<FakeRuntime>) -> Arc<Manager> {
    let store = Store::open(&data_dir.join("sandpit.db"))
        .await
        .expect("store");
    let mut runtimes: BTreeMap<String, Arc<dyn Runtime>> = BTreeMap::new();
    runtimes.insert(FAKE.into(), fake);
    let volumes = Arc::new(sandpit_runtime::volume::VolumeHost::new(data_dir).expect("volumes"));
    let broker = crate::broker::Broker::with_key(
        &crate::broker::BrokerConfig::default(),
        store.clone(),
        None,
    )
    .await
    .expect("broker");
    let snapshots = crate::snapshots::SnapshotStore::open(&Default::default(), data_dir)
        .expect("snapshot store");
    Manager::new(
        store,
        runtimes,
        volumes,
        Arc::new(broker),
        ManagerConfig {
            data_dir: data_dir.to_path_buf(),
            lifecycle: Default::default(),
            max_timeout_secs: 3600,
            default_runtime: FAKE.into(),
            allow_process_runtime: false,
            agents: Default::default(),
            pool_limits: Default::default(),
            approvals: Default::default(),
        },
        snapshots,
    )
}
