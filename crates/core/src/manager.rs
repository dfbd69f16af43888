//! The lifecycle manager: creates and destroys sandboxes, keeps the store in step with the
//! runtimes, expires sandboxes at their TTL, notices dead agents, and reconciles after a
//! restart so that nothing is leaked whether the daemon stopped cleanly or was killed.

use crate::agent_conn::AgentConn;
use crate::error::CoreError;
use crate::pools::{POOL_OWNER, PoolKey, PoolView, Pools};
use sandpit_api::PoolSpec;
use sandpit_api::{CreateSandboxRequest, Limits};
use sandpit_runtime::{Liveness, Runtime, SandboxHandle, SandboxSpec, TemplateSource};
use sandpit_store::{Claim, PoolRecord};
use sandpit_store::{SandboxRecord, SandboxState, Store};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Limits applied when a request leaves them out.
pub const DEFAULT_LIMITS: Limits = Limits {
    cpu_millis: 1000,
    memory_bytes: 512 << 20,
    disk_bytes: 1 << 30,
    max_processes: 512,
};
/// Accepted ranges of each limit.
pub const CPU_RANGE: (u64, u64) = (50, 64_000);
pub const MEMORY_RANGE: (u64, u64) = (32 << 20, 64 << 30);
pub const DISK_RANGE: (u64, u64) = (1 << 20, 64 << 30);
pub const PROCESSES_RANGE: (u64, u64) = (8, 65_536);
/// Working directory of commands when a create names none.
pub const DEFAULT_WORKDIR: &str = "/home/user";
/// Default sandbox lifetime in seconds.
pub const DEFAULT_TIMEOUT: u64 = 300;

/// Daemon-wide settings the manager needs.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The daemon's data directory (layers and local snapshots live below it).
    pub data_dir: std::path::PathBuf,
    /// Idle and lifetime rules.
    pub lifecycle: crate::lifecycle::LifecycleConfig,
    pub max_timeout_secs: u64,
    pub default_runtime: String,
    /// Whether clients may ask for the unisolated `process` runtime.
    pub allow_process_runtime: bool,
}

/// Owns sandbox lifecycles.
pub struct Manager {
    pub store: Store,
    pub runtimes: BTreeMap<String, Arc<dyn Runtime>>,
    pub cfg: ManagerConfig,
    conns: Mutex<HashMap<String, Arc<AgentConn>>>,
    /// Warm pools and their ready queues.
    pub pools: Pools,
    /// Wakes the pool refiller.
    pool_wake: tokio::sync::Notify,
    /// Refills in flight.
    refilling: AtomicUsize,
    /// Set at shutdown: no new refills start.
    pools_stopped: std::sync::atomic::AtomicBool,
    /// When a sandbox was last claimed from a pool (refills hold back briefly after one).
    last_claim: Mutex<Option<std::time::Instant>>,
    /// Background teardowns in flight (a clean shutdown waits for them).
    teardowns: Arc<AtomicUsize>,
    /// The host side of volumes.
    pub volumes: Arc<sandpit_runtime::volume::VolumeHost>,
    /// One lock per sandbox for pause, resume, hibernation, snapshots and forks.
    pub(crate) ops: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// API activity per sandbox not yet written to the store.
    pub(crate) activity: Mutex<HashMap<String, i64>>,
    /// Layers being made, which garbage collection must leave alone.
    pub(crate) layer_pins: Mutex<HashMap<String, usize>>,
    /// One layer garbage collection at a time.
    pub(crate) gc_lock: tokio::sync::Mutex<()>,
    /// Set when a sandbox with layers went: the next tick collects unused layers.
    pub(crate) gc_wanted: Arc<std::sync::atomic::AtomicBool>,
    /// Where snapshot archives are stored.
    pub snapshot_store: crate::snapshots::SnapshotStore,
    /// Sandboxes whose automatic pause failed, and when.
    pub(crate) auto_failures: Mutex<HashMap<String, std::time::Instant>>,
    /// Template builds, and creates holding templates.
    pub templates: crate::templates::Templates,
    /// Usage metering queue.
    pub usage: crate::usage::Usage,
    /// The credential broker (secrets, sandbox CAs, the egress proxy's interceptor).
    pub broker: Arc<crate::broker::Broker>,
    /// Sandbox networking, when the daemon has it.
    pub net: std::sync::OnceLock<Arc<crate::net::Net>>,
}

/// What the agent's `/init` sets.
struct AgentInit<'a> {
    env: &'a BTreeMap<String, String>,
    workdir: Option<&'a str>,
    user: Option<&'a str>,
}

/// Everything a cold start records about a new sandbox.
pub(crate) struct NewSandbox<'a> {
    pub owner: &'a str,
    /// The warm pool it is made for.
    pub pool: Option<String>,
    pub plan: Plan,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub workdir: String,
    pub expires_at_ms: i64,
    pub life: sandpit_store::Lifecycle,
}

/// What becomes of a record whose runtime side failed to start.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Failed {
    /// A new sandbox: the record goes.
    Delete,
    /// A sandbox coming back (from hibernation): the record returns to this state.
    Restore(SandboxState),
}

/// Everything a create needs once the request is validated.
#[derive(Clone)]
pub(crate) struct Plan {
    pub(crate) runtime: Arc<dyn Runtime>,
    pub(crate) key: PoolKey,
    pub(crate) template: TemplateSource,
    /// Volumes to mount (never for a pool's sandboxes).
    pub(crate) volumes: Vec<sandpit_api::VolumeMountSpec>,
    /// The template's settings (and the hold that keeps it from being deleted meanwhile).
    pub(crate) defaults: crate::templates::Defaults,
    /// Egress policy (None: no network of its own, or an idle pool member's `none`).
    pub(crate) network: Option<crate::net::policy::Policy>,
}

impl Plan {
    /// The plan's limits as the runtime takes them.
    pub(crate) fn runtime_limits(&self) -> sandpit_runtime::Limits {
        let l = self.key.limits;
        sandpit_runtime::Limits {
            cpu_millis: l.cpu_millis,
            memory_bytes: l.memory_bytes,
            disk_bytes: l.disk_bytes,
            max_processes: l.max_processes,
        }
    }
}

pub use sandpit_store::now_ms;

pub(crate) fn new_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn in_range(name: &str, v: u64, (lo, hi): (u64, u64)) -> Result<u64, CoreError> {
    if v < lo || v > hi {
        return Err(CoreError::invalid(format!(
            "{name} must be between {lo} and {hi}, got {v}"
        )));
    }
    Ok(v)
}

/// Validates caller-defined labels.
pub fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), CoreError> {
    if metadata.len() > 64
        || metadata
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > 256 || v.len() > 1024)
    {
        return Err(CoreError::invalid(
            "metadata: at most 64 entries, keys 1..=256 and values up to 1024 bytes",
        ));
    }
    Ok(())
}

/// Checks an environment variable name and value.
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), CoreError> {
    for (k, v) in env {
        let valid_name = !k.is_empty() && k.len() <= 256 && !k.contains(['=', '\0']);
        if !valid_name || v.contains('\0') || v.len() > 128 * 1024 {
            return Err(CoreError::invalid(format!(
                "invalid environment variable {k:?}"
            )));
        }
    }
    if env.len() > 1024 {
        return Err(CoreError::invalid("at most 1024 environment variables"));
    }
    Ok(())
}

fn check_pool_size(size: u32) -> Result<(), CoreError> {
    if size > crate::pools::MAX_POOL_SIZE {
        return Err(CoreError::invalid(format!(
            "pool size must be at most {}",
            crate::pools::MAX_POOL_SIZE
        )));
    }
    Ok(())
}

/// Waits until `count` is zero, or `max` has passed.
async fn wait_for_zero(count: &AtomicUsize, max: Duration) {
    let deadline = tokio::time::Instant::now() + max;
    while count.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `Runtime::destroy` on a blocking thread.
pub(crate) async fn run_destroy(rt: Arc<dyn Runtime>, h: SandboxHandle) -> Result<(), String> {
    match tokio::task::spawn_blocking(move || rt.destroy(&h)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("destroy task: {e}")),
    }
}

/// A sandbox's liveness, asked a few times over half a second while the answer is
/// `Unknown` (a start under descriptor pressure should not mistake a busy host for death).
async fn settled_liveness(rt: Arc<dyn Runtime>, h: SandboxHandle) -> Liveness {
    let mut last = Liveness::Unknown("not checked".into());
    for attempt in 0..5 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (rt, h) = (rt.clone(), h.clone());
        last = match tokio::task::spawn_blocking(move || rt.liveness(&h)).await {
            Ok(l) => l,
            Err(e) => Liveness::Unknown(format!("liveness check failed: {e}")),
        };
        if !matches!(last, Liveness::Unknown(_)) {
            break;
        }
    }
    last
}

fn handle_of(rec: &SandboxRecord) -> Option<SandboxHandle> {
    serde_json::from_value(rec.runtime_state.clone()).ok()
}

impl Manager {
    /// A manager over the given store and runtimes.
    pub fn new(
        store: Store,
        runtimes: BTreeMap<String, Arc<dyn Runtime>>,
        volumes: Arc<sandpit_runtime::volume::VolumeHost>,
        broker: Arc<crate::broker::Broker>,
        cfg: ManagerConfig,
        snapshot_store: crate::snapshots::SnapshotStore,
    ) -> Arc<Self> {
        Arc::new(Self {
            templates: crate::templates::Templates::new(&cfg.data_dir),
            store,
            runtimes,
            cfg,
            conns: Mutex::default(),
            pools: Pools::default(),
            pool_wake: tokio::sync::Notify::new(),
            refilling: AtomicUsize::new(0),
            pools_stopped: Default::default(),
            teardowns: Arc::default(),
            last_claim: Mutex::default(),
            volumes,
            ops: Mutex::default(),
            activity: Mutex::default(),
            layer_pins: Mutex::default(),
            gc_lock: tokio::sync::Mutex::new(()),
            gc_wanted: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            snapshot_store,
            auto_failures: Mutex::default(),
            usage: Default::default(),
            broker,
            net: Default::default(),
        })
    }

    fn runtime(&self, name: &str) -> Result<&Arc<dyn Runtime>, CoreError> {
        self.runtimes
            .get(name)
            .ok_or_else(|| CoreError::invalid(format!("unknown runtime {name:?}")))
    }

    /// The effective limits of a request, validated.
    pub fn limits(l: &sandpit_api::LimitsSpec) -> Result<Limits, CoreError> {
        Ok(Limits {
            cpu_millis: in_range(
                "cpu_millis",
                l.cpu_millis.unwrap_or(DEFAULT_LIMITS.cpu_millis),
                CPU_RANGE,
            )?,
            memory_bytes: in_range(
                "memory_bytes",
                l.memory_bytes.unwrap_or(DEFAULT_LIMITS.memory_bytes),
                MEMORY_RANGE,
            )?,
            disk_bytes: in_range(
                "disk_bytes",
                l.disk_bytes.unwrap_or(DEFAULT_LIMITS.disk_bytes),
                DISK_RANGE,
            )?,
            max_processes: in_range(
                "max_processes",
                l.max_processes.unwrap_or(DEFAULT_LIMITS.max_processes),
                PROCESSES_RANGE,
            )?,
        })
    }

    pub fn timeout(&self, t: Option<u64>) -> Result<u64, CoreError> {
        let t = t.unwrap_or(DEFAULT_TIMEOUT.min(self.cfg.max_timeout_secs));
        if t == 0 || t > self.cfg.max_timeout_secs {
            return Err(CoreError::invalid(format!(
                "timeout must be between 1 and {} seconds",
                self.cfg.max_timeout_secs
            )));
        }
        Ok(t)
    }

    /// Validates runtime, template and limits of a create or a pool definition.
    pub(crate) async fn plan(
        &self,
        template: Option<&str>,
        runtime: Option<&str>,
        limits: &sandpit_api::LimitsSpec,
    ) -> Result<Plan, CoreError> {
        let runtime_name = runtime
            .map(str::to_string)
            .unwrap_or_else(|| self.cfg.default_runtime.clone());
        if runtime_name == "process" && !self.cfg.allow_process_runtime {
            return Err(CoreError::Forbidden(
                "the unisolated process runtime is disabled; start the daemon with --allow-process-runtime (development only)".into(),
            ));
        }
        let runtime = self.runtime(&runtime_name)?.clone();
        let template_name = template.unwrap_or("host").to_string();
        let (template, defaults) = self.templates.resolve(&self.store, &template_name).await?;
        let limits = Self::limits(limits)?;
        Ok(Plan {
            runtime,
            key: PoolKey {
                template: template_name,
                runtime: runtime_name,
                limits,
            },
            template,
            volumes: Vec::new(),
            defaults,
            network: None,
        })
    }

    /// Creates a sandbox and returns it running: a ready one from a matching warm pool
    /// when there is one, else started cold (on a snapshot's files when it names one).
    /// On any failure nothing is left behind.
    pub async fn create(
        self: &Arc<Self>,
        owner: &str,
        mut req: CreateSandboxRequest,
    ) -> Result<SandboxRecord, CoreError> {
        let secrets = std::mem::take(&mut req.secrets);
        self.broker.check_names(owner, &secrets).await?;
        let restore = match req.snapshot.as_deref() {
            Some(s) => Some(self.restore_plan(owner, s).await?),
            None => None,
        };
        if let Some(r) = &restore {
            let snap = &r.snapshot;
            if req.template.as_ref().is_some_and(|t| *t != snap.template)
                || req.runtime.as_ref().is_some_and(|t| *t != snap.runtime)
            {
                return Err(CoreError::invalid(format!(
                    "snapshot {} runs on template {:?} with runtime {:?}; leave them out",
                    snap.id, snap.template, snap.runtime
                )));
            }
            req.template = Some(snap.template.clone());
            req.runtime = Some(snap.runtime.clone());
            let l = &mut req.limits;
            l.cpu_millis = l.cpu_millis.or(r.limits.cpu_millis);
            l.memory_bytes = l.memory_bytes.or(r.limits.memory_bytes);
            l.disk_bytes = l.disk_bytes.or(r.limits.disk_bytes);
            l.max_processes = l.max_processes.or(r.limits.max_processes);
            let mut env = r.env.clone();
            env.append(&mut req.env);
            req.env = env;
            req.workdir = req.workdir.take().or_else(|| r.workdir.clone());
            req.user = req.user.take().or_else(|| r.user.clone());
            req.network = req.network.take().or_else(|| r.network.clone());
        }
        let mut plan = self
            .plan(req.template.as_deref(), req.runtime.as_deref(), &req.limits)
            .await?;
        let req = crate::templates::with_defaults(req, &plan.defaults);
        crate::volumes::check_mounts(&req.volumes)?;
        plan.volumes = req.volumes.clone();
        plan.network =
            crate::net::plan_policy(self.net.get(), &plan.key.runtime, req.network.as_ref())?;
        let timeout = self.timeout(req.timeout)?;
        check_env(&req.env)?;
        check_metadata(&req.metadata)?;
        let workdir = req
            .workdir
            .clone()
            .unwrap_or_else(|| DEFAULT_WORKDIR.into());
        if !workdir.starts_with('/')
            || workdir.contains('\0')
            || workdir.split('/').any(|c| c == "..")
        {
            return Err(CoreError::invalid(
                "workdir must be an absolute path without '..'",
            ));
        }
        if let Some(u) = &req.user
            && !matches!(u.as_str(), "user" | "root")
        {
            return Err(CoreError::invalid(format!(
                "unknown user {u:?}: sandboxes have `user` and `root`"
            )));
        }
        let on_timeout = match req.on_timeout.as_deref() {
            None | Some("kill") => sandpit_store::OnTimeout::Kill,
            Some("pause") => sandpit_store::OnTimeout::Pause,
            Some(other) => {
                return Err(CoreError::invalid(format!(
                    "on_timeout is `kill` or `pause`, not {other:?}"
                )));
            }
        };
        let life = sandpit_store::Lifecycle {
            layers: restore
                .as_ref()
                .map(|r| r.layers.clone())
                .unwrap_or_default(),
            snapshot: restore.as_ref().map(|r| r.snapshot.id.clone()),
            last_activity_ms: now_ms(),
            idle_timeout_secs: req
                .idle_timeout
                .unwrap_or(self.cfg.lifecycle.idle_timeout_secs),
            on_timeout,
            auto_resume: req.auto_resume.unwrap_or(true),
            paused_at_ms: None,
            workdir: (workdir != DEFAULT_WORKDIR).then(|| workdir.clone()),
            user: req.user.clone(),
            timeout_secs: timeout,
        };
        let expires_at_ms = now_ms() + (timeout as i64) * 1000;
        let (secure, public) = (req.secure, req.public);
        // A pool's sandbox is running already and cannot get mounts any more.
        if restore.is_none()
            && plan.volumes.is_empty()
            && let Some(rec) = self
                .claim(owner, &plan.key, &req, &workdir, expires_at_ms, &life)
                .await
        {
            if let Err(e) = crate::net::assign(self.net.get(), &rec, plan.network.clone()).await {
                let _ = self.destroy(&rec).await;
                return Err(e.into());
            }
            let rec = self.with_proxy_access(rec, secure, public).await?;
            return self.with_secrets(rec, &secrets).await;
        }
        let rec = self
            .start_new(NewSandbox {
                owner,
                pool: None,
                plan,
                env: req.env,
                metadata: req.metadata,
                workdir,
                expires_at_ms,
                life,
            })
            .await?;
        let rec = self.with_proxy_access(rec, secure, public).await?;
        self.with_secrets(rec, &secrets).await
    }

    /// Gives a new (or newly claimed) sandbox fresh proxy credentials; without them it goes.
    async fn with_proxy_access(
        &self,
        rec: SandboxRecord,
        secure: Option<bool>,
        public: Option<bool>,
    ) -> Result<SandboxRecord, CoreError> {
        if let Err(e) = crate::access::on_create(self, &rec.id, secure, public).await {
            let _ = self.destroy(&rec).await;
            return Err(e);
        }
        Ok(rec)
    }

    /// Starts a new sandbox cold and applies its default user.
    pub(crate) async fn start_new(&self, new: NewSandbox<'_>) -> Result<SandboxRecord, CoreError> {
        let user = new.life.user.clone();
        let rec = self.cold_create(new).await?;
        if let Some(user) = user.as_deref()
            && let Err(e) = self.set_default_user(&rec, user).await
        {
            let _ = self.destroy(&rec).await;
            return Err(e);
        }
        Ok(rec)
    }

    /// Takes a ready sandbox from the pool matching `key`, hands it to `owner` and applies
    /// the caller's settings through the agent's `/init`. `None` means start cold.
    async fn claim(
        self: &Arc<Self>,
        owner: &str,
        key: &PoolKey,
        req: &CreateSandboxRequest,
        workdir: &str,
        expires_at_ms: i64,
        life: &sandpit_store::Lifecycle,
    ) -> Option<SandboxRecord> {
        let mut pool_name = None;
        while let Some((pool, member)) = self.pools.take(key) {
            if let Ok(mut at) = self.last_claim.lock() {
                *at = Some(std::time::Instant::now());
            }
            self.pool_wake.notify_one();
            pool_name = Some(pool.clone());
            let Some(id) = member else { break };
            let claim = Claim {
                owner,
                env: &req.env,
                metadata: &req.metadata,
                expires_at_ms,
                life,
            };
            let rec = match self.store.claim_pooled(&id, &pool, &claim).await {
                Ok(Some(rec)) => rec,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(id, error = %e, "claiming a pooled sandbox failed");
                    if !self.pools.put_back(&pool, id.clone()) {
                        self.destroy_ids(vec![id]).await;
                    }
                    break;
                }
            };
            let init = AgentInit {
                env: &req.env,
                // Pool members start in the default workdir already.
                workdir: (workdir != DEFAULT_WORKDIR).then_some(workdir),
                user: req.user.as_deref(),
            };
            match self.init_agent(&rec, &init).await {
                Ok(()) => {
                    crate::usage::on_state(self, &rec, SandboxState::Running);
                    self.count_pool(&pool, true);
                    tracing::debug!(id, pool, "sandbox claimed from pool");
                    return Some(rec);
                }
                Err(e) => {
                    tracing::warn!(id, pool, error = %e.chain(), "pooled sandbox refused its settings; destroying it");
                    let _ = self.destroy(&rec).await;
                }
            }
        }
        if let Some(pool) = pool_name {
            self.count_pool(&pool, false);
        }
        None
    }

    fn count_pool(self: &Arc<Self>, pool: &str, hit: bool) {
        self.pools.count(pool, hit);
        let (me, pool) = (self.clone(), pool.to_string());
        tokio::spawn(async move {
            let (h, m) = if hit { (1, 0) } else { (0, 1) };
            if let Err(e) = me.store.count_pool(&pool, h, m).await {
                tracing::warn!(pool, error = %e, "counting a pool claim failed");
            }
        });
    }

    /// `POST /init` on the agent: the caller's env, default workdir and user.
    async fn init_agent(&self, rec: &SandboxRecord, init: &AgentInit<'_>) -> Result<(), CoreError> {
        if init.env.is_empty() && init.workdir.is_none() && init.user.is_none() {
            // Nothing to change: spare the caller a round trip.
            return Ok(());
        }
        let (_, h) = self.runtime_of(rec)?;
        let conn = self.conn_for(&rec.id, &h);
        let body = serde_json::json!({
            "envVars": init.env,
            "defaultWorkdir": init.workdir,
            "defaultUser": init.user,
        });
        let request = http::Request::post(format!("{}/init", crate::agent_conn::AGENT_BASE))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(crate::agent_conn::full_body(body.to_string()))
            .map_err(|e| CoreError::internal(e.to_string()))?;
        let answer = tokio::time::timeout(Duration::from_secs(5), conn.http.request(request))
            .await
            .map_err(|_| CoreError::unavailable("the sandbox agent did not answer /init"))?
            .map_err(|e| CoreError::unavailable(format!("agent /init: {e}")))?;
        if answer.status().is_success() {
            Ok(())
        } else {
            Err(CoreError::unavailable(format!(
                "agent /init answered {}",
                answer.status()
            )))
        }
    }

    /// Starts a sandbox from nothing and records it; on failure nothing is left behind.
    async fn cold_create(&self, new: NewSandbox<'_>) -> Result<SandboxRecord, CoreError> {
        let NewSandbox {
            owner,
            pool,
            plan,
            env,
            metadata,
            workdir,
            expires_at_ms,
            life,
        } = new;
        let now = now_ms();
        let limits = plan.key.limits;
        let rec = SandboxRecord {
            id: new_id(),
            owner: owner.to_string(),
            template: plan.key.template.clone(),
            runtime: plan.key.runtime.clone(),
            state: SandboxState::Creating,
            cpu_millis: limits.cpu_millis as i64,
            memory_bytes: limits.memory_bytes as i64,
            disk_bytes: limits.disk_bytes as i64,
            max_processes: limits.max_processes as i64,
            env: env.clone(),
            metadata,
            created_at_ms: now,
            updated_at_ms: now,
            expires_at_ms,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
            pool,
            life,
        };
        let ca = self.broker.ca_pem_soon(&rec.id);
        self.store.insert_sandbox(&rec).await?;
        if let Err(e) = crate::net::assign(self.net.get(), &rec, plan.network.clone()).await {
            let _ = self.store.delete_sandbox(&rec.id).await;
            return Err(e.into());
        }
        let volumes = match self.attach_volumes(&rec.id, owner, &plan.volumes).await {
            Ok(v) => v,
            Err(e) => {
                let _ = self.store.delete_sandbox(&rec.id).await;
                return Err(e);
            }
        };
        let spec = SandboxSpec {
            id: rec.id.clone(),
            template: plan.template,
            limits: sandpit_runtime::Limits {
                cpu_millis: limits.cpu_millis,
                memory_bytes: limits.memory_bytes,
                disk_bytes: limits.disk_bytes,
                max_processes: limits.max_processes,
            },
            env,
            workdir,
            volumes,
            layers: self.start_layers(&rec, &plan.defaults)?,
            extra_ca_pem: ca.await,
            net: None,
        };
        self.boot(&rec, plan.runtime, spec, Failed::Delete).await
    }

    /// Starts the runtime side of a record in `creating` and waits until its agent
    /// answers. On failure the runtime side is gone again, and the record is deleted or
    /// put back as `failed` says.
    pub(crate) async fn boot(
        &self,
        rec: &SandboxRecord,
        runtime: Arc<dyn Runtime>,
        spec: SandboxSpec,
        failed: Failed,
    ) -> Result<SandboxRecord, CoreError> {
        let forget_record = || async {
            match failed {
                Failed::Delete => {
                    let _ = self.store.delete_sandbox(&rec.id).await;
                }
                Failed::Restore(state) => {
                    let _ = self
                        .store
                        .transition(&rec.id, &[SandboxState::Creating], state, None)
                        .await;
                }
            }
        };
        let rt = runtime.clone();
        let created = tokio::task::spawn_blocking(move || {
            let mut h = rt.create(&spec)?;
            if let Err(e) = rt.start(&spec, &mut h) {
                if let Err(c) = rt.destroy(&h) {
                    tracing::error!(id = %spec.id, error = %c, "cleanup after a failed start");
                }
                return Err(e);
            }
            Ok(h)
        })
        .await;
        let handle = match created {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                forget_record().await;
                return Err(e.into());
            }
            Err(e) => {
                forget_record().await;
                return Err(CoreError::internal(format!("create task: {e}")));
            }
        };
        let destroy_now = || async {
            let _ = run_destroy(runtime.clone(), handle.clone()).await;
            self.forget(&rec.id);
            forget_record().await;
        };
        let state =
            serde_json::to_value(&handle).map_err(|e| CoreError::internal(e.to_string()))?;
        if let Err(e) = self.store.set_runtime_state(&rec.id, &state).await {
            // Deleted before the handle was recorded: that delete could not tear the
            // sandbox down, so this create does.
            let _ = run_destroy(runtime.clone(), handle.clone()).await;
            self.forget(&rec.id);
            if matches!(failed, Failed::Delete) {
                let _ = self.store.delete_sandbox(&rec.id).await;
            }
            return Err(match e {
                sandpit_store::StoreError::NotFound(_) => {
                    CoreError::conflict("sandbox was deleted while it was being created")
                }
                other => other.into(),
            });
        }
        let ready = async {
            crate::templates::start_services(self, rec, &handle).await?;
            self.wait_ready(rec, &handle).await
        };
        match ready.await {
            Ok(r) => {
                crate::usage::on_state(self, &r, SandboxState::Running);
                Ok(r)
            }
            Err(e) => {
                // Whoever moves the record out of `creating` tears it down; if a delete
                // did, it holds the handle and does the work.
                let ours = match failed {
                    Failed::Delete => {
                        self.store
                            .transition(
                                &rec.id,
                                &[SandboxState::Creating],
                                SandboxState::Stopping,
                                None,
                            )
                            .await
                    }
                    Failed::Restore(_) => Ok(Some(rec.clone())),
                };
                if matches!(ours, Ok(Some(_)) | Err(_)) {
                    destroy_now().await;
                }
                Err(e)
            }
        }
    }

    /// Waits for the agent to answer, then marks the sandbox running.
    async fn wait_ready(
        &self,
        rec: &SandboxRecord,
        handle: &SandboxHandle,
    ) -> Result<SandboxRecord, CoreError> {
        let conn = self.conn_for(&rec.id, handle);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut delay = Duration::from_micros(200);
        let deleted = || CoreError::conflict("sandbox was deleted while it was being created");
        // An agent answers within milliseconds; only a slow one gets its record looked at
        // (every 100 ms), so that a delete meanwhile ends the wait without costing every
        // start a read of the store.
        let mut next_check = tokio::time::Instant::now() + Duration::from_millis(100);
        while !conn.healthy().await {
            let now = tokio::time::Instant::now();
            if now > deadline {
                return Err(CoreError::unavailable(
                    "the sandbox agent did not become ready",
                ));
            }
            if now >= next_check {
                next_check = now + Duration::from_millis(100);
                match self.store.get_sandbox(&rec.id).await? {
                    Some(r) if r.state == SandboxState::Creating => {}
                    _ => return Err(deleted()),
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(20));
        }
        self.store
            .transition(
                &rec.id,
                &[SandboxState::Creating],
                SandboxState::Running,
                None,
            )
            .await?
            .ok_or_else(deleted)
    }

    /// A sandbox's read-only layers at start: its own, then its template's.
    pub(crate) fn start_layers(
        &self,
        rec: &SandboxRecord,
        template: &crate::templates::Defaults,
    ) -> Result<Vec<std::path::PathBuf>, CoreError> {
        let mut layers = self.layer_paths(rec)?;
        layers.extend(template.layers.iter().cloned());
        Ok(layers)
    }

    /// Whether a request is using the sandbox's agent right now (a long command, a
    /// stream): the connection is then held beyond the manager's own reference.
    pub(crate) fn has_requests_in_flight(&self, id: &str) -> bool {
        self.conns
            .lock()
            .ok()
            .and_then(|c| c.get(id).map(|conn| Arc::strong_count(conn) > 1))
            .unwrap_or(false)
    }

    /// Makes `user` the default user of a running sandbox's commands.
    pub(crate) async fn set_default_user(
        &self,
        rec: &SandboxRecord,
        user: &str,
    ) -> Result<(), CoreError> {
        let init = AgentInit {
            env: &BTreeMap::new(),
            workdir: None,
            user: Some(user),
        };
        self.init_agent(rec, &init).await
    }

    pub fn conn_for(&self, id: &str, handle: &SandboxHandle) -> Arc<AgentConn> {
        let Ok(mut conns) = self.conns.lock() else {
            return Arc::new(AgentConn::new(handle.socket.clone()));
        };
        conns
            .entry(id.to_string())
            .or_insert_with(|| Arc::new(AgentConn::new(handle.socket.clone())))
            .clone()
    }

    pub(crate) fn forget(&self, id: &str) {
        if let Ok(mut conns) = self.conns.lock() {
            conns.remove(id);
        }
    }

    /// A sandbox of `owner`; anyone else's is reported as not found.
    pub async fn get(&self, owner: &str, id: &str) -> Result<SandboxRecord, CoreError> {
        match self.store.get_sandbox(id).await? {
            // A sandbox being torn down is already gone as far as callers are concerned.
            Some(r) if r.owner == owner && r.state != SandboxState::Stopping => {
                self.touch(id);
                Ok(r)
            }
            _ => Err(CoreError::sandbox_not_found(id)),
        }
    }

    /// The agent of a running sandbox of `owner`.
    pub async fn agent(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<(SandboxRecord, Arc<AgentConn>), CoreError> {
        let mut rec = self.get(owner, id).await?;
        if rec.state == SandboxState::Creating {
            // A hibernated sandbox starting again (woken by another request) holds its op
            // lock until it runs: wait for that rather than refuse this request.
            drop(self.op_lock(id).await);
            rec = self.get(owner, id).await?;
        }
        if rec.state.is_final() {
            return Err(CoreError::sandbox_stopped(id, rec.state.as_str()));
        }
        if matches!(rec.state, SandboxState::Paused | SandboxState::Hibernated)
            && rec.life.auto_resume
        {
            rec = self.resume(&rec).await?;
        }
        if rec.state != SandboxState::Running {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        }
        let handle =
            handle_of(&rec).ok_or_else(|| CoreError::internal("sandbox has no runtime state"))?;
        Ok((rec.clone(), self.conn_for(&rec.id, &handle)))
    }

    /// Runtime and handle of a sandbox.
    pub fn runtime_of(
        &self,
        rec: &SandboxRecord,
    ) -> Result<(Arc<dyn Runtime>, SandboxHandle), CoreError> {
        let rt = self.runtime(&rec.runtime)?.clone();
        let h = handle_of(rec)
            .ok_or_else(|| CoreError::conflict("sandbox has no runtime state yet"))?;
        Ok((rt, h))
    }

    /// Makes a sandbox unreachable at once and removes its resources and record in the
    /// background. A crash before that finishes leaves a `stopping` record, which the next
    /// start's reconcile finishes off.
    pub async fn destroy(&self, rec: &SandboxRecord) -> Result<(), CoreError> {
        // The state change is the claim on the teardown: whoever moves the record to
        // `stopping` tears the sandbox down, so it happens exactly once. `stopped` means
        // the resources are gone already (the liveness sweep removed them).
        let from = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Hibernated,
            SandboxState::Error,
        ];
        let Some(cur) = self
            .store
            .transition(&rec.id, &from, SandboxState::Stopping, None)
            .await?
        else {
            if let Some(now) = self.store.get_sandbox(&rec.id).await?
                && now.state == SandboxState::Stopped
            {
                self.store.delete_sandbox(&rec.id).await?;
            }
            return Ok(());
        };
        crate::usage::on_state(self, &cur, SandboxState::Stopping);
        self.forget(&cur.id);
        self.pools.forget(&cur.id);
        // Set once the record is gone: its layers are unused from then on.
        let gc = (!cur.life.layers.is_empty()).then(|| self.gc_wanted.clone());
        let store = self.store.clone();
        let id = cur.id.clone();
        // The handle comes from the row just changed: a copy read before the create
        // finished may not have it yet.
        match (self.runtime(&cur.runtime).cloned(), handle_of(&cur)) {
            (Ok(rt), Some(h)) => {
                rt.begin_stop(&h);
                let teardowns = self.teardowns.clone();
                teardowns.fetch_add(1, Ordering::AcqRel);
                tokio::spawn(async move {
                    let done = match run_destroy(rt, h).await {
                        Ok(()) => store.delete_sandbox(&id).await.map(drop),
                        Err(why) => {
                            tracing::error!(id, error = %why, "tearing down a sandbox failed");
                            store
                                .transition(
                                    &id,
                                    &[SandboxState::Stopping],
                                    SandboxState::Error,
                                    Some(&why),
                                )
                                .await
                                .map(drop)
                        }
                    };
                    if let Err(e) = done {
                        tracing::warn!(id, error = %e, "recording a teardown failed");
                    }
                    if let Some(gc) = gc {
                        gc.store(true, Ordering::Release);
                    }
                    teardowns.fetch_sub(1, Ordering::AcqRel);
                });
            }
            // Never started (or its create is still under way and will find the record
            // gone and clean up after itself).
            _ => {
                self.store.delete_sandbox(&id).await?;
                if let Some(gc) = gc {
                    gc.store(true, Ordering::Release);
                }
            }
        }
        Ok(())
    }

    /// At shutdown: starts no more refills and waits (up to `max`) for those under way,
    /// so that none finishes unrecorded or for a pool deleted meanwhile after the daemon
    /// has gone (their own teardowns are then awaited by [`Self::drain_teardowns`]).
    pub async fn stop_pools(&self, max: Duration) {
        self.pools_stopped.store(true, Ordering::Release);
        self.pool_wake.notify_one();
        wait_for_zero(&self.refilling, max).await;
    }

    /// Waits (up to `max`) for background teardowns to finish; what is left is finished by
    /// the next start's reconcile.
    pub async fn drain_teardowns(&self, max: Duration) {
        wait_for_zero(&self.teardowns, max).await;
    }

    /// Sets the sandbox to expire `secs` from now.
    pub async fn set_timeout(&self, rec: &SandboxRecord, secs: u64) -> Result<(), CoreError> {
        let secs = self.timeout(Some(secs))?;
        self.store
            .set_expires_at(&rec.id, now_ms() + secs as i64 * 1000)
            .await?;
        Ok(())
    }

    /// One pass of housekeeping: expire sandboxes past their TTL and clean up dead ones.
    pub async fn tick(self: &Arc<Self>) {
        let states = [
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Hibernated,
            SandboxState::Error,
        ];
        match self.store.expired_sandboxes(now_ms(), &states).await {
            Ok(expired) => {
                for rec in expired {
                    self.expire(&rec).await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing expired sandboxes failed"),
        }
        let Ok(live) = self.store.live_sandboxes().await else {
            return;
        };
        self.lifecycle_tick(&live).await;
        let running: Vec<(SandboxRecord, Arc<dyn Runtime>, SandboxHandle)> = live
            .into_iter()
            .filter(|r| r.state == SandboxState::Running)
            .filter_map(|r| self.runtime_of(&r).ok().map(|(rt, h)| (r, rt, h)))
            .collect();
        // One blocking task for the whole sweep: with a thousand sandboxes, a task each
        // would cost more than the /proc reads themselves.
        let swept = tokio::task::spawn_blocking(move || {
            let mut dead = Vec::new();
            let mut unknown = Vec::new();
            for (r, rt, h) in running {
                match rt.liveness(&h) {
                    Liveness::Alive => {}
                    Liveness::Dead => dead.push(r),
                    Liveness::Unknown(why) => unknown.push((r.id, why)),
                }
            }
            (dead, unknown)
        })
        .await;
        // A sweep that could not run proves nothing either.
        let Ok((dead, unknown)) = swept else { return };
        if let Some((id, why)) = unknown.first() {
            // Under descriptor or memory pressure /proc cannot be read: the sandboxes are
            // left alone until there is evidence (ENOENT, a zombie, a reused pid).
            tracing::warn!(count = unknown.len(), first = %id, error = %why,
                "cannot tell whether sandboxes are alive; leaving them running");
        }
        for rec in dead {
            self.mark_dead(&rec, "the sandbox's agent exited").await;
        }
    }

    /// Removes a dead sandbox's resources and records it as stopped (why), unless a
    /// delete got to it first: moving the record to `stopping` claims the teardown.
    async fn mark_dead(&self, rec: &SandboxRecord, why: &str) {
        let from = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
        ];
        let cur = match self
            .store
            .transition(&rec.id, &from, SandboxState::Stopping, None)
            .await
        {
            Ok(Some(cur)) => cur,
            // Deleted meanwhile: the delete tears it down.
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(id = %rec.id, error = %e, "marking sandbox stopped failed");
                return;
            }
        };
        crate::usage::on_state(self, &cur, SandboxState::Stopping);
        tracing::warn!(id = %cur.id, why, "sandbox stopped; cleaning up");
        let (to, note) = match self.teardown_now(&cur).await {
            Ok(()) => (SandboxState::Stopped, why.to_string()),
            // Left in `error` so that a delete tries the teardown again.
            Err(e) => (SandboxState::Error, format!("{why}; teardown failed: {e}")),
        };
        if cur.owner == POOL_OWNER && to == SandboxState::Stopped {
            // Nobody can ever look at an unclaimed pool member's record.
            let _ = self.store.delete_sandbox(&cur.id).await;
            return;
        }
        if let Err(e) = self
            .store
            .transition(&cur.id, &[SandboxState::Stopping], to, Some(&note))
            .await
        {
            tracing::warn!(id = %cur.id, error = %e, "recording a stopped sandbox failed");
        }
        if !cur.life.layers.is_empty() {
            self.gc_wanted.store(true, Ordering::Release);
        }
    }

    /// Removes a sandbox's resources and waits for it.
    async fn teardown_now(&self, rec: &SandboxRecord) -> Result<(), String> {
        self.forget(&rec.id);
        self.pools.forget(&rec.id);
        match self.runtime_of(rec) {
            Ok((rt, h)) => run_destroy(rt, h).await.inspect_err(|e| {
                tracing::warn!(id = %rec.id, error = %e, "teardown failed");
            }),
            Err(_) => Ok(()),
        }
    }

    /// After a start: re-adopt live sandboxes, clean up dead and half-made ones, and sweep
    /// runtime leftovers that the store does not know.
    pub async fn reconcile(&self) -> Result<(), CoreError> {
        // Archives half-written or half-downloaded when the daemon stopped.
        let tmp = self.cfg.data_dir.join("tmp");
        if tmp.exists()
            && let Err(e) = std::fs::remove_dir_all(&tmp)
        {
            tracing::warn!(dir = %tmp.display(), error = %e, "removing leftover temporary files failed");
        }
        let live = self.store.live_sandboxes().await?;
        let mut keep = Vec::new();
        for rec in live {
            if rec.state == SandboxState::Hibernated {
                // Nothing of it runs; its files are in its layers.
                continue;
            }
            if rec.state == SandboxState::Creating && rec.life.paused_at_ms.is_some() {
                // A wake from hibernation cut short: whatever it started goes, and the
                // sandbox is hibernated again on the files it had.
                tracing::info!(id = %rec.id, "finishing an interrupted wake: back to hibernated");
                if let Err(e) = self.teardown_now(&rec).await {
                    tracing::warn!(id = %rec.id, error = %e, "removing a half-woken sandbox failed");
                }
                let _ = self
                    .store
                    .transition(
                        &rec.id,
                        &[SandboxState::Creating],
                        SandboxState::Hibernated,
                        None,
                    )
                    .await;
                continue;
            }
            let usable = match self.runtime_of(&rec) {
                Ok((rt, h)) => {
                    let (rt2, h2) = (rt.clone(), h.clone());
                    let liveness = settled_liveness(rt2, h2).await;
                    // A paused sandbox's agent is frozen and cannot answer; it is adopted
                    // on the strength of its process alone.
                    let answers = rec.state == SandboxState::Paused
                        || self.conn_for(&rec.id, &h).healthy().await;
                    let settled =
                        !matches!(rec.state, SandboxState::Creating | SandboxState::Stopping);
                    match liveness {
                        Liveness::Alive if settled && answers => {
                            rt.adopt(&h);
                            true
                        }
                        // No evidence either way: keep it (its resources too); the sweep
                        // decides once /proc can be read again.
                        Liveness::Unknown(why) if settled => {
                            tracing::warn!(id = %rec.id, error = %why,
                                "cannot tell whether a sandbox survived; keeping it");
                            rt.adopt(&h);
                            true
                        }
                        _ => false,
                    }
                }
                Err(_) => false,
            };
            if rec.state == SandboxState::Stopping {
                tracing::info!(id = %rec.id, "finishing an interrupted teardown");
                match self.teardown_now(&rec).await {
                    Ok(()) => {
                        let _ = self.store.delete_sandbox(&rec.id).await;
                    }
                    Err(e) => {
                        let _ = self
                            .store
                            .transition(
                                &rec.id,
                                &[SandboxState::Stopping],
                                SandboxState::Error,
                                Some(&format!("teardown failed: {e}")),
                            )
                            .await;
                    }
                }
            } else if usable {
                tracing::info!(id = %rec.id, "re-adopted sandbox");
                keep.push(rec.id.clone());
            } else if rec.state == SandboxState::Creating {
                tracing::info!(id = %rec.id, "removing half-created sandbox");
                self.mark_dead(&rec, "half-created").await;
                let _ = self.store.delete_sandbox(&rec.id).await;
            } else {
                tracing::info!(id = %rec.id, "sandbox died while the daemon was down");
                self.mark_dead(&rec, "the sandbox died while the daemon was not running")
                    .await;
            }
        }
        for rt in self.runtimes.values() {
            let (rt, keep) = (rt.clone(), keep.clone());
            match tokio::task::spawn_blocking(move || rt.remove_orphans(&keep)).await {
                Ok(Ok(removed)) if !removed.is_empty() => {
                    tracing::info!(?removed, "removed orphaned sandbox leftovers")
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "sweeping orphans failed"),
                _ => {}
            }
        }
        Ok(())
    }

    // ---- warm pools ----

    /// Validates a pool definition into a store record.
    async fn pool_record(&self, spec: &PoolSpec, source: &str) -> Result<PoolRecord, CoreError> {
        let name_ok = !spec.name.is_empty()
            && spec.name.len() <= 64
            && spec
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(CoreError::invalid(
                "pool name must be 1 to 64 characters of [a-zA-Z0-9_-]",
            ));
        }
        check_pool_size(spec.size)?;
        let plan = self
            .plan(
                spec.template.as_deref(),
                spec.runtime.as_deref(),
                &spec.limits,
            )
            .await?;
        let l = plan.key.limits;
        Ok(PoolRecord {
            name: spec.name.clone(),
            template: plan.key.template,
            runtime: plan.key.runtime,
            cpu_millis: l.cpu_millis as i64,
            memory_bytes: l.memory_bytes as i64,
            disk_bytes: l.disk_bytes as i64,
            max_processes: l.max_processes as i64,
            size: spec.size as i64,
            source: source.to_string(),
            hits: 0,
            misses: 0,
            created_at_ms: now_ms(),
        })
    }

    /// Creates a pool through the API; it fills in the background.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolView, CoreError> {
        let def = self.pool_record(spec, "api").await?;
        let key = PoolKey::of(&def);
        if let Some(other) = self
            .pools
            .views()
            .into_iter()
            .find(|v| PoolKey::of(&v.def) == key)
        {
            return Err(CoreError::conflict(format!(
                "pool {} already keeps sandboxes of this template, runtime and limits",
                other.def.name
            )));
        }
        self.store.insert_pool(&def).await?;
        let stale = self.pools.define(def);
        self.destroy_ids(stale).await;
        self.pool_wake.notify_one();
        self.pools
            .view(&spec.name)
            .ok_or_else(|| CoreError::internal("pool vanished"))
    }

    /// Changes how many idle sandboxes a pool keeps; extra idle ones are destroyed.
    pub async fn resize_pool(&self, name: &str, size: u32) -> Result<PoolView, CoreError> {
        check_pool_size(size)?;
        if !self.store.resize_pool(name, size as i64).await? {
            return Err(CoreError::not_found(format!("pool {name} not found")));
        }
        let extra = self.pools.resize(name, size).unwrap_or_default();
        self.destroy_ids(extra).await;
        self.pool_wake.notify_one();
        self.pools
            .view(name)
            .ok_or_else(|| CoreError::not_found(format!("pool {name} not found")))
    }

    /// Removes a pool and destroys its idle sandboxes (claimed ones stay their owners').
    pub async fn delete_pool(&self, name: &str) -> Result<(), CoreError> {
        if !self.store.delete_pool(name).await? {
            return Err(CoreError::not_found(format!("pool {name} not found")));
        }
        let members = self.pools.remove(name).unwrap_or_default();
        self.destroy_ids(members).await;
        Ok(())
    }

    async fn destroy_ids(&self, ids: Vec<String>) {
        for id in ids {
            match self.store.get_sandbox(&id).await {
                Ok(Some(rec)) => {
                    if let Err(e) = self.destroy(&rec).await {
                        tracing::warn!(id, error = %e.chain(), "destroying an idle pool member failed");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(id, error = %e, "reading an idle pool member failed"),
            }
        }
    }

    /// After reconcile: applies the config file's pools (which replace earlier config
    /// pools), loads every pool, adopts surviving idle members and destroys the rest.
    pub async fn load_pools(&self, from_config: &[PoolSpec]) -> Result<(), CoreError> {
        let mut declared = Vec::new();
        for spec in from_config {
            // A refused entry (say, its template is missing just now) keeps what the store
            // has: only a pool taken out of the file is removed.
            declared.push(spec.name.clone());
            match self.pool_record(spec, "config").await {
                Ok(def) => self.store.upsert_pool(&def).await?,
                Err(e) => {
                    tracing::error!(pool = %spec.name, error = %e.chain(), "pool in the config file refused")
                }
            }
        }
        let mut keys: Vec<PoolKey> = Vec::new();
        for def in self.store.list_pools().await? {
            if def.source == "config" && !declared.contains(&def.name) {
                tracing::info!(pool = %def.name, "pool removed from the config file");
                self.store.delete_pool(&def.name).await?;
                continue;
            }
            let key = PoolKey::of(&def);
            if keys.contains(&key) {
                tracing::error!(pool = %def.name, "another pool keeps sandboxes of the same template, runtime and limits; this one is not used");
                continue;
            }
            keys.push(key);
            self.pools.define(def);
        }
        match self.store.delete_final_pool_records().await {
            Ok(n) if n > 0 => tracing::info!(n, "removed records of dead idle pool sandboxes"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "removing records of dead pool sandboxes failed"),
        }
        let mut unwanted = Vec::new();
        let mut members: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for rec in self.store.live_sandboxes().await? {
            if rec.owner != POOL_OWNER {
                continue;
            }
            // A member is adopted only into a pool whose definition it still matches (the
            // config file may have changed the limits while the daemon was down).
            let own_key = PoolKey::of_sandbox(&rec);
            let pool = rec.pool.clone().unwrap_or_default();
            let fits = self.pools.key(&pool).is_some_and(|k| k == own_key);
            if fits && rec.state == SandboxState::Running {
                members.entry(pool).or_default().push(rec.id);
            } else {
                unwanted.push(rec.id);
            }
        }
        for (pool, ids) in members {
            let n = ids.len();
            let extra = self.pools.adopt(&pool, ids);
            tracing::info!(
                pool,
                adopted = n - extra.len(),
                "re-adopted idle pool sandboxes"
            );
            unwanted.extend(extra);
        }
        self.destroy_ids(unwanted).await;
        self.pool_wake.notify_one();
        Ok(())
    }

    /// Keeps every pool at its size, a few starts at a time, until the daemon stops.
    pub async fn run_pools(self: Arc<Self>) {
        let mut held_since: Option<std::time::Instant> = None;
        loop {
            // A claimed sandbox's caller usually runs a command right away; a refill
            // starting at that moment would take the CPU from it. Hold refills while claims
            // are recent, but never for long, so that a stream of claims cannot starve them.
            let recent = self
                .last_claim
                .lock()
                .ok()
                .and_then(|at| *at)
                .map(|at| at.elapsed())
                .filter(|e| *e < crate::pools::REFILL_QUIET);
            if let Some(elapsed) = recent {
                let since = *held_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() < crate::pools::REFILL_MAX_HOLD {
                    tokio::time::sleep(crate::pools::REFILL_QUIET - elapsed).await;
                    continue;
                }
            }
            held_since = None;
            if self.pools_stopped.load(Ordering::Acquire) {
                return;
            }
            let budget = crate::pools::REFILL_CONCURRENCY
                .saturating_sub(self.refilling.load(Ordering::Acquire));
            for refill in self.pools.plan_refills(budget) {
                self.refilling.fetch_add(1, Ordering::AcqRel);
                let me = self.clone();
                tokio::spawn(async move {
                    let id = me.refill(&refill).await;
                    if !me.pools.started(&refill, id.clone())
                        && let Some(id) = id
                    {
                        me.destroy_ids(vec![id]).await;
                    }
                    me.refilling.fetch_sub(1, Ordering::AcqRel);
                    me.pool_wake.notify_one();
                });
            }
            // Woken by claims and finished refills; the timeout retries after a backoff.
            let _ =
                tokio::time::timeout(Duration::from_millis(500), self.pool_wake.notified()).await;
        }
    }

    /// Starts one idle member of a pool.
    async fn refill(&self, refill: &crate::pools::Refill) -> Option<String> {
        let k = &refill.key;
        let spec = sandpit_api::LimitsSpec {
            cpu_millis: Some(k.limits.cpu_millis),
            memory_bytes: Some(k.limits.memory_bytes),
            disk_bytes: Some(k.limits.disk_bytes),
            max_processes: Some(k.limits.max_processes),
        };
        let started = async {
            let plan = self
                .plan(Some(&k.template), Some(&k.runtime), &spec)
                .await?;
            self.cold_create(NewSandbox {
                owner: POOL_OWNER,
                pool: Some(refill.pool.clone()),
                plan,
                env: BTreeMap::new(),
                metadata: BTreeMap::new(),
                workdir: DEFAULT_WORKDIR.into(),
                // Idle pool members never expire; a claim sets the caller's deadline.
                expires_at_ms: i64::MAX,
                life: Default::default(),
            })
            .await
        };
        match started.await {
            Ok(rec) => Some(rec.id),
            Err(e) => {
                tracing::warn!(pool = %refill.pool, error = %e.chain(), "refilling a pool failed");
                None
            }
        }
    }
}

impl Manager {
    /// Gives a sandbox just made the secrets its create named; if that fails, the sandbox
    /// goes again, so that a create either has its secrets or leaves nothing.
    pub(crate) async fn with_secrets(
        &self,
        rec: sandpit_store::SandboxRecord,
        names: &[String],
    ) -> Result<sandpit_store::SandboxRecord, CoreError> {
        if names.is_empty() {
            return Ok(rec);
        }
        if let Err(e) = self.broker.attach(&rec.id, &rec.owner, names).await {
            if let Err(d) = self.destroy(&rec).await {
                tracing::warn!(id = %rec.id, error = %d.chain(), "removing a sandbox whose secrets failed");
            }
            return Err(e.into());
        }
        Ok(rec)
    }
}
