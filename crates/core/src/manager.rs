//! The lifecycle manager: creates and destroys sandboxes, keeps the store in step with the
//! runtimes, expires sandboxes at their TTL, notices dead agents, and reconciles after a
//! restart so that nothing is leaked whether the daemon stopped cleanly or was killed.

use crate::agent_conn::AgentConn;
use crate::error::CoreError;
use crate::pools::{PoolKey, Pools};
use parking_lot::Mutex;
use sandpit_api::Limits;
use sandpit_runtime::{Runtime, SandboxHandle, TemplateSource};
use sandpit_store::{SandboxRecord, SandboxState, Store};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

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
    /// Agent-run settings (`[agents]`).
    pub agents: crate::agent_runtime::AgentsConfig,
    /// Bounds on warm pools (`[pool_limits]`).
    pub pool_limits: crate::pools::PoolLimits,
    /// Approval settings (`[approvals]`).
    pub approvals: crate::approvals::ApprovalsConfig,
}

/// Owns sandbox lifecycles.
pub struct Manager {
    pub(crate) store: Store,
    pub(crate) runtimes: BTreeMap<String, Arc<dyn Runtime>>,
    pub(crate) cfg: ManagerConfig,
    pub(crate) conns: Mutex<HashMap<String, Arc<AgentConn>>>,
    /// Warm pools and their ready queues.
    pub(crate) pools: Pools,
    /// Wakes the pool refiller.
    pub(crate) pool_wake: tokio::sync::Notify,
    /// Refills in flight.
    pub(crate) refilling: AtomicUsize,
    /// Set at shutdown: no new refills start.
    pub(crate) pools_stopped: std::sync::atomic::AtomicBool,
    /// When a sandbox was last claimed from a pool (refills hold back briefly after one).
    pub(crate) last_claim: Mutex<Option<std::time::Instant>>,
    /// Background teardowns in flight (a clean shutdown waits for them).
    pub(crate) teardowns: Arc<AtomicUsize>,
    /// The host side of volumes.
    pub(crate) volumes: Arc<sandpit_runtime::volume::VolumeHost>,
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
    pub(crate) snapshot_store: crate::snapshots::SnapshotStore,
    /// Sandboxes whose automatic pause failed, and when.
    pub(crate) auto_failures: Mutex<HashMap<String, std::time::Instant>>,
    /// Agent runs this daemon is driving.
    pub(crate) agent_runs: Arc<crate::agent_run::LiveRuns>,
    /// Actions held for a person's approval.
    pub(crate) approvals: Arc<crate::approvals::Approvals>,
    /// Template builds, and creates holding templates.
    pub(crate) templates: crate::templates::Templates,
    /// Usage metering queue.
    pub(crate) usage: crate::usage::Usage,
    /// The credential broker (secrets, sandbox CAs, the egress proxy's interceptor).
    pub(crate) broker: Arc<crate::broker::Broker>,
    /// Sandbox networking, when the daemon has it.
    pub(crate) net: std::sync::OnceLock<Arc<crate::net::Net>>,
}

/// What the agent's `/init` sets.
pub(crate) struct AgentInit<'a> {
    pub(crate) env: &'a BTreeMap<String, String>,
    pub(crate) workdir: Option<&'a str>,
    pub(crate) user: Option<&'a str>,
}

/// Everything a cold start records about a new sandbox.
pub(crate) struct NewSandbox<'a> {
    pub owner: &'a str,
    /// The warm pool it is made for.
    pub pool: Option<String>,
    pub plan: Plan,
    pub env: BTreeMap<String, String>,
    /// Names of the `env` variables whose values are secret.
    pub secret_env: BTreeSet<String>,
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

pub(crate) fn in_range(name: &str, v: u64, (lo, hi): (u64, u64)) -> Result<u64, CoreError> {
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

/// The names of `env` a create marks secret, each of which must be a key of `env`: a
/// name without a value would protect nothing and is most likely a typo.
pub fn check_secret_env(
    env: &BTreeMap<String, String>,
    names: &[String],
) -> Result<BTreeSet<String>, CoreError> {
    if let Some(missing) = names.iter().find(|n| !env.contains_key(n.as_str())) {
        return Err(CoreError::invalid(format!(
            "secret_env names {missing:?}, which is not a variable of env"
        )));
    }
    Ok(names.iter().cloned().collect())
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

pub(crate) fn handle_of(rec: &SandboxRecord) -> Option<SandboxHandle> {
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
        let approvals = Arc::new(crate::approvals::Approvals::new(
            store.clone(),
            cfg.approvals.max_pending_per_run,
        ));
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
            agent_runs: Arc::default(),
            approvals,
            usage: Default::default(),
            broker,
            net: Default::default(),
        })
    }

    pub(crate) fn runtime(&self, name: &str) -> Result<&Arc<dyn Runtime>, CoreError> {
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

    /// Whether a request is using the sandbox's agent right now (a long command, a
    /// stream): the connection is then held beyond the manager's own reference.
    pub(crate) fn has_requests_in_flight(&self, id: &str) -> bool {
        self.conns
            .lock()
            .get(id)
            .is_some_and(|conn| Arc::strong_count(conn) > 1)
    }

    pub fn conn_for(&self, id: &str, handle: &SandboxHandle) -> Arc<AgentConn> {
        self.conns
            .lock()
            .entry(id.to_string())
            .or_insert_with(|| Arc::new(AgentConn::new(handle.socket.clone())))
            .clone()
    }

    pub(crate) fn forget(&self, id: &str) {
        self.conns.lock().remove(id);
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

    /// Sets the sandbox to expire `secs` from now.
    pub async fn set_timeout(&self, rec: &SandboxRecord, secs: u64) -> Result<(), CoreError> {
        let secs = self.timeout(Some(secs))?;
        self.store
            .set_expires_at(&rec.id, now_ms() + secs as i64 * 1000)
            .await?;
        Ok(())
    }

    // ---- warm pools ----
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

/// What callers outside the core may read or do with the manager's parts; its fields stay
/// its own.
impl Manager {
    /// The daemon-wide settings it was made with.
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// Sandbox networking, once attached (absent when the host cannot give sandboxes
    /// networks of their own).
    pub fn net(&self) -> Option<&Arc<crate::net::Net>> {
        self.net.get()
    }

    /// Attaches sandbox networking; only the first call counts.
    pub fn attach_net(&self, net: Arc<crate::net::Net>) {
        let _ = self.net.set(net);
    }

    /// Whether sandboxes of this runtime are isolated from the host.
    pub fn is_isolated(&self, runtime: &str) -> bool {
        self.runtimes
            .get(runtime)
            .is_some_and(|r| r.capabilities().isolated)
    }

    /// The registered runtimes, by name (including ones not offered to clients).
    pub fn runtimes(&self) -> impl Iterator<Item = (&str, &Arc<dyn Runtime>)> {
        self.runtimes.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Warm pools as they are now.
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    /// The template registry and builds.
    pub fn templates(&self) -> &crate::templates::Templates {
        &self.templates
    }

    /// Metering: usage events and execution records.
    pub fn usage(&self) -> &crate::usage::Usage {
        &self.usage
    }

    /// The credential broker (the ingress reads a sandbox's `maskRequestHost` from it).
    pub fn broker(&self) -> &Arc<crate::broker::Broker> {
        &self.broker
    }

    /// Lets go of host resources held for the process's life (runtime helpers, volume
    /// mounts) at shutdown; sandboxes keep running.
    pub fn release_host(&self) {
        for rt in self.runtimes.values() {
            rt.release();
        }
        self.volumes.release();
    }
}

impl Manager {
    /// A sandbox's record by id, whoever owns it: for the ingress, which authorizes with
    /// the sandbox's own tokens rather than an owner.
    pub async fn find(&self, id: &str) -> Result<Option<SandboxRecord>, CoreError> {
        Ok(self.store.get_sandbox(id).await?)
    }
}
